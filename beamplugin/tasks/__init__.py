from beamplugin.tasks import beam_translation  # noqa: F401  (registers the task)
