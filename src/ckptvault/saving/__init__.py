"""Writing generations: the generation writer (capture -> DCP -> manifest -> sign ->
publish), the save scheduler (sync, async, backpressure) and save handles; when to
save: ``policy`` (``cv.Every``, ``cv.Planned``, ``cv.Any``) and ``decider`` (one
``should_save`` answer for every rank)."""
