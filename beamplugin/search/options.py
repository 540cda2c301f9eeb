"""How a search decodes: one frozen options object, built and validated once and read by every
part of the search (as CTranslate2's ``DecodingOptions``)."""

from __future__ import annotations

from dataclasses import dataclass

from beamplugin.search.vocabulary_map import VocabularyMap

STOPPING_RULES = ("fairseq", "exact")
LENGTH_PENALTY_STYLES = ("fairseq", "gnmt")
ALIGNMENT_KINDS = (None, "hard", "soft")
DEVICE_ENGINE_CHOICES = ("auto", "on", "off")
CONSTRAINT_KINDS = (None, "ordered", "unordered")

# (min_len_a, min_len_b, max_len_a, max_len_b): the per-sentence length bounds of fairseq's
# LengthConstrainedBeamSearch, ``a * source length + b``
LengthConstraints = tuple[float, float, float, float]


@dataclass(frozen=True)
class DecodingOptions:
    """The search's options in fairseq's terms, with the special tokens of the target dictionary.

    ``max_len`` is the model's limit (output tokens plus EOS), ``nbest`` at most ``beam_size``.
    ``stopping``: ``"fairseq"`` ends a sentence once it holds ``beam_size`` finished hypotheses
    (or at max length); ``"exact"`` only when, besides, no live hypothesis can still beat the
    worst of them. ``length_penalty_style``: ``"fairseq"`` divides scores by
    ``len ** len_penalty``, ``"gnmt"`` by ``((5 + len) / 6) ** len_penalty`` (``len`` counts
    EOS). ``print_alignment``: ``"hard"`` or ``"soft"`` fills each hypothesis' alignment.
    ``attention``: each hypothesis keeps its attention over the source, as from fairseq's
    generator (fairseq-generate and -interactive read it only to print alignments); without it
    a search keeps no attention history. ``shortlist``: each sentence may take only the tokens
    its source brings in through this map, its probabilities normalised over them (None: the
    whole vocabulary). ``device_engine``: the whole step on the device, in fixed rows
    (beamplugin.engine.device_engine), "auto" on a GPU where it serves the model and options,
    "on" also on the CPU, "off" never; ``cuda_graphs``: its steps replayed as CUDA graphs.
    ``constraints``: how requests' lexical constraints are met (fairseq's ``--constraints``:
    ``"ordered"`` or ``"unordered"``, beamplugin.search.constraints); None: a request with
    constraints is refused.
    """

    eos: int
    pad: int
    unk: int
    max_len: int
    beam_size: int = 1
    nbest: int = 1
    max_len_a: float = 0
    max_len_b: int = 200
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    length_penalty_style: str = "fairseq"
    unk_penalty: float = 0.0
    temperature: float = 1.0
    match_source_len: bool = False
    no_repeat_ngram_size: int = 0
    suppressed: tuple[int, ...] = ()  # token ids never chosen outside a forced prefix
    length_constraints: LengthConstraints | None = None
    stopping: str = "fairseq"
    print_alignment: str | None = None
    attention: bool = True
    shortlist: VocabularyMap | None = None
    device_engine: str = "auto"
    cuda_graphs: bool = True
    constraints: str | None = None

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {self.beam_size}")
        if not 1 <= self.nbest <= self.beam_size:
            raise ValueError(
                f"nbest must be between 1 and beam_size={self.beam_size}, got {self.nbest}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be greater than 0, got {self.temperature}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(
                f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}"
            )
        if self.stopping not in STOPPING_RULES:
            raise ValueError(f"stopping must be one of {STOPPING_RULES}, got {self.stopping!r}")
        if self.length_penalty_style not in LENGTH_PENALTY_STYLES:
            raise ValueError(
                f"length_penalty_style must be one of {LENGTH_PENALTY_STYLES}, "
                f"got {self.length_penalty_style!r}"
            )
        if self.device_engine not in DEVICE_ENGINE_CHOICES:
            raise ValueError(
                f"device_engine must be one of {DEVICE_ENGINE_CHOICES}, got {self.device_engine!r}"
            )
        if self.print_alignment not in ALIGNMENT_KINDS:
            raise ValueError(
                f"print_alignment must be 'hard', 'soft' or None, got {self.print_alignment!r}"
            )
        if self.constraints not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraints must be 'ordered', 'unordered' or None, got {self.constraints!r}"
            )
        if self.print_alignment and not self.attention:
            raise ValueError("print_alignment needs the attention (attention=True)")
        longest = min(self.max_len_b, self.max_len - 1)
        if self.max_len_a == 0 and self.min_len > longest:
            raise ValueError(
                f"min_len={self.min_len} is larger than the maximum output length {longest} "
                f"(max_len_b={self.max_len_b}, max_len={self.max_len})"
            )
