"""Helpers the tests share: training setups, forgers, servers, workers started as subprocesses."""
