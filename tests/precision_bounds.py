"""How close half-precision decoding must stay to float32: shared by test_precision.py (CPU)
and test_cuda.py (GPU), so that both hold the same bounds."""

N_SENTENCES = 64
# Measured on these models, beam 5, 64 sentences: the top hypothesis equals float32's for
# convs2s on 59 (92%), for fairseq's transformer on 55 (86%); their length-normalised scores
# differ by at most 0.0093 and 0.033. The bounds leave room for other CPUs' kernels.
MIN_SAME_SHARE = 0.8
SCORE_TOLERANCE = 0.05
