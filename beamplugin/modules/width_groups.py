"""The sentences of one encoder batch in groups of similar width, each group encoded padded to
its own widest source, not the batch's: on the CPU an encoder's products cost per row, and a
batch padded to its widest source (as fairseq's batches are) spent some 40% of them on padding
at random lengths of 5 to 40 tokens. Encoding a sentence gives the same bits whatever the
padding beside it, so the groups change no result."""

from __future__ import annotations

import math

# What one more encoder call costs, in rows of padding: each call reads every weight once more
# and its products run fewer rows (a guess within a factor of two costs little either way).
CALL_ROWS = 32


def cheapest_runs(rows_at: dict[int, int], call_cost: float) -> list[list[int]]:
    """The widths of ``rows_at`` (width: its rows) in the runs of the sorted widths that cost
    least, narrowest first: a run costs ``call_cost`` plus its rows times its widest (dynamic
    programming over the distinct widths, a few dozen at most)."""
    widths = sorted(rows_at)
    # cost[j]: of the rows of widths[:j]; start[j]: where its last run starts
    cost, start = [0.0], [0]
    for j, width in enumerate(widths, 1):
        rows, best, first = 0, math.inf, 0
        for i in range(j - 1, -1, -1):  # the last run: widths[i:j]
            rows += rows_at[widths[i]]
            run_cost = cost[i] + call_cost + rows * width
            if run_cost < best:
                best, first = run_cost, i
        cost.append(best)
        start.append(first)
    runs, j = [], len(widths)
    while j:
        runs.append(widths[start[j] : j])
        j = start[j]
    return runs[::-1]


def width_groups(lengths: list[int]) -> list[tuple[list[int], int]]:
    """The sentences of own ``lengths`` in the groups that cost least (:func:`cheapest_runs`,
    a call costing :data:`CALL_ROWS`), each as its sentences (indices into ``lengths``,
    shortest first) and its width (its longest)."""
    count_of: dict[int, int] = {}
    for length in lengths:
        count_of[length] = count_of.get(length, 0) + 1
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, taken = [], 0
    for run in cheapest_runs(count_of, CALL_ROWS):
        size = sum(count_of[w] for w in run)
        groups.append((order[taken : taken + size], run[-1]))
        taken += size
    return groups
