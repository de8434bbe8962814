"""Writing generations: the generation writer (capture -> DCP -> manifest -> sign ->
publish), the save scheduler (sync, async, backpressure) and save handles."""
