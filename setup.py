"""beamplugin: a fairseq user dir with a ConvS2S model and a fast, exact batched beam search."""

from setuptools import find_packages, setup

# Pinned so that a fresh machine gets exactly what was tested.
#  - torch 2.13.0: the CPU build lies on this machine's disk; an unpinned torch pulls a CUDA build.
#  - ve-fairseq 0.12.3: fairseq 0.12.2 does not import on Python 3.11; this is a prebuilt cp311
#    wheel of fairseq's main branch (fairseq-fixed needs ~8 minutes of compiling). See README.
#  - torchaudio 2.11.0: ve-fairseq requires some torchaudio; 2.11.0 declares no torch pin, so it
#    sits beside torch 2.13.0 instead of dragging in another torch; fairseq's text code never
#    uses it.
#  - aiohttp, prometheus-client: the translation server (beamplugin-serve); selenium (dev): its
#    page tested in a real browser. See README, "Why these pins".
#  - langcodes, language-data: the names of /languages. See docs/dependencies.md.
#  - limits: the server's requests per minute (--req-limit); openapi-spec-validator and
#    jsonschema (dev): its /spec checked, and its answers against it; psutil (dev): the soak's
#    resident memory. See docs/dependencies.md.
#  - sentencex: the server's documents cut into sentences (rules for ~300 languages in the
#    package); py3langid: /detect and source "auto" (its model in the package); lxml (dev): the
#    tests parse HTML with a second parser. See docs/dependencies.md.
#  - srt, python-docx, odfdo (and its lxml, installed rather than dev only now): the server's
#    subtitle, Word and OpenDocument files (POST /translate_file) read and written. See
#    docs/dependencies.md.
#  - tqdm: beamplugin-translate's progress bar (fairseq pulls it in unpinned); ray (extra
#    "cluster", installed by make test too): beamplugin-translate --ray. See docs/cluster.md.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "ve-fairseq==0.12.3",
    "torchaudio==2.11.0",
    "numpy==2.4.6",
    "sentencepiece==0.2.3",
    "sacrebleu==2.6.0",
    "aiohttp==3.14.5",
    "prometheus-client==0.26.0",
    "limits==5.8.0",
    "langcodes==3.5.1",
    "language-data==1.4.0",
    "tqdm==4.70.1",
    "sentencex==1.0.32",
    "py3langid==0.4.0",
    "srt==3.5.3",
    "python-docx==1.2.0",
    "odfdo==3.27.3",
    "lxml==6.1.3",
]

setup(
    name="beamplugin",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["beamplugin", "beamplugin.*"]),
    python_requires=">=3.11",
    package_data={
        "beamplugin.serving": ["page.html", "docs.html"],
        "beamplugin.kernels": ["native/*.c", "native/*.h", "native/*/*.h"],  # built on first use
    },
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "dev": [
            "pytest==9.2.0",
            "pytest-xdist==3.8.0",
            "ruff==0.17.6",
            "selenium==4.51.0",
            "import-linter==2.17",
            "openapi-spec-validator==0.9.0",
            "jsonschema==4.26.0",
            "psutil==7.2.2",
        ],
        # beamplugin-translate --ray (docs/cluster.md); make test installs it with dev
        "cluster": ["ray==2.60.0"],
        # benchmarks/generate.py only: CTranslate2 decodes the same checkpoints there
        "bench": ["ctranslate2==4.8.5"],
    },
    entry_points={
        "console_scripts": [
            "beamplugin-serve = beamplugin.serving.cli:cli_main",
            "beamplugin-translate = beamplugin.corpus.cli:cli_main",
            "beamplugin-vocabulary-map = beamplugin.fairseq_plugin.vocabulary_map_cli:cli_main",
        ]
    },
)
