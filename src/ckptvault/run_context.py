"""``RunContext``: what every part of one run's manager shares.

The generation writer, the restorer and (later) retention and replication all act
for one run, in one store, under one trust context, on one rank of one job, and
report to one event bus. Bundling those five keeps the parts' signatures short
and makes it obvious that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptvault.coordinator import Coordinator
from ckptvault.events import EventBus
from ckptvault.storage.base import Store
from ckptvault.trust.context import TrustContext


@dataclass(frozen=True)
class RunContext:
    store: Store
    run_id: str
    trust: TrustContext
    coordinator: Coordinator
    events: EventBus
