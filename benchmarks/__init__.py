"""beamplugin's benchmarks, each a module run from the repository's root as
``python -m benchmarks.NAME [options]`` (docs/performance.md lists them). ``common`` holds what
they share (machine description, timing, result records written with ``--results FILE``),
``models`` the models several of them (and the tests) build, ``in_process`` the timing of
fairseq's generator and ours in one process (``generate``'s second part, ``roofline``'s
tools); ``render_tables`` renders the records of ``results/`` into README.md and docs/
(``make tables``).
"""
