from beamplugin.models import convs2s  # noqa: F401  (registers the model and its archs)
