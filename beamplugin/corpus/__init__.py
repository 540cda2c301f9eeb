"""Corpora of any size translated line for line in blocks, each written once and resumed where a
stopped job left off: on this process's stream, or on a Ray cluster (``beamplugin-translate``)."""
