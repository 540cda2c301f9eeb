"""beamplugin-serve: loading, the decoder process, the translator, the HTTP app, its metrics and
command line."""
