"""The per-call (or submit) figure of two source trees, A/B by turns in one process: whether a
hot-path change helps, on a machine whose spells move every figure more than the change does.

    python bench/ab.py <other-tree> [--rounds 8] [--calls 40] [--billed | --submit]

A is this tree, B the other (a `git worktree` of another commit, say), each run as its own stack
(web, one exec and one tools worker, its own database and Redis prefix) with this interpreter. Each
round runs one job of ``--calls`` sequential `Demo.echo` (`Demo.add` with ``--billed``) on each
stack, A first in even rounds and B first in odd ones: the one measured second has been ~3.5%
quicker with the same code, so each tree is taken as often in either place. Prints the medians and
p95 of each, their ratio, the same by position, and the ratio round by round, with how likely
B's count of quicker rounds is by chance. Many short rounds judge best on a busy machine: a pair of
jobs measured close together shares its spell (``--rounds 150 --calls 20`` takes a minute).

With ``--submit`` a round is, on each stack, ``--calls`` submits of `print(1)` with `wait` back to
back, then as many 0.15 s apart (as bench/spine.py's rows), each figure judged as above, with the
apart submits' phases (the job's own timestamps) of either tree.
"""

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import harness
import httpx
from harness import print_table, row, run_job, running_stack, timed
from spine import PER_CALL, PER_CALL_BILLED, PHASES, STACK_ENV, apart, submit_phased

import tests.servers
import tests.stack


def rooted(tree: Path) -> None:
    """Make ``tree`` the cwd of the stack started next: its migrate, its key and its processes
    import that tree's code (every module global a stack's start reads its root from)."""
    harness.ROOT = tests.stack.ROOT = tests.servers.ROOT = tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other source tree (B)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each one job on either stack (default 8)")
    parser.add_argument("--calls", type=int, default=40, help="sequential calls in each job (default 40)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--billed", action="store_true", help="Demo.add (its price held, then settled) for Demo.echo")
    kind.add_argument("--submit", action="store_true", help="submit -> result of print(1), back to back and 0.15 s apart")
    args = parser.parse_args()
    if args.rounds < 2:  # each tree is measured first in one round at least, and second in another
        parser.error("--rounds must be 2 or more")
    trees = {"A": harness.ROOT, "B": args.other.resolve()}
    if not (trees["B"] / "manage.py").is_file():
        sys.exit(f"{trees['B']} is not a source tree of this project (no manage.py)")
    # Each figure's ms of one round on one stack.
    phases: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    if args.submit:
        title = f"{args.calls} submits of print(1) with wait"

        def measure(client: httpx.Client, label: str) -> dict[str, list[float]]:
            submit = lambda: run_job(client, "print(1)", wait=30)  # noqa: E731
            return {
                "back to back": timed(submit, args.calls),
                "0.15 s apart": apart(lambda: submit_phased(client, phases[label]), args.calls),
            }
    else:
        tool = "Demo.add" if args.billed else "Demo.echo"
        title = f"a job of {args.calls} sequential {tool}"
        job = (PER_CALL_BILLED if args.billed else PER_CALL).replace("N", str(args.calls))

        def measure(client: httpx.Client, label: str) -> dict[str, list[float]]:
            return {"per call": run_job(client, job)["return_value"]}

    with ExitStack() as stacks:
        clients = {}
        for label, tree in trees.items():
            rooted(tree)
            _, clients[label] = stacks.enter_context(running_stack(STACK_ENV, name=f"ab-{label}"))
        rooted(trees["A"])
        for label, client in clients.items():  # the first job on fresh workers pays their connections
            measure(client, label)
        for warming in phases.values():
            warming.clear()
        taken, by_round = by_turns(args.rounds, {label: partial(measure, client, label) for label, client in clients.items()})

    for figure in taken:
        judged(
            f"{figure}, {title}: A {trees['A']}, B {trees['B']}; {args.rounds} rounds by turns", taken[figure], by_round[figure]
        )
    if args.submit:
        print_table(
            "Submit -> result 0.15 s apart, by phase (the job's own timestamps)",
            [
                beside(
                    f"{label}: {name}", [p[name] for p in phases[label]], [p[name] for p in phases["A"]] if label == "B" else None
                )
                for name, _, _ in PHASES
                for label in ("A", "B")
            ],
        )


# taken[figure][label][position]: a figure's ms of either tree, measured first (0) or second (1)
Taken = dict[str, dict[str, tuple[list[float], list[float]]]]


def by_turns(rounds: int, measure: dict[str, Callable[[], dict[str, list[float]]]]) -> tuple[Taken, dict[str, list[float]]]:
    """Run ``measure`` of A and B by turns, ``rounds`` times, A first in even rounds and B in odd
    ones; return each figure's ms by tree and position, and its B/A ratio of medians round by round."""
    taken: Taken = {}
    by_round: dict[str, list[float]] = {}
    for n in range(rounds):
        order = ("A", "B") if n % 2 == 0 else ("B", "A")
        medians: dict[str, dict[str, float]] = {}
        for position, label in enumerate(order):
            for figure, samples in measure[label]().items():
                taken.setdefault(figure, {"A": ([], []), "B": ([], [])})[label][position].extend(samples)
                medians.setdefault(figure, {})[label] = statistics.median(samples)
        for figure, median in medians.items():
            by_round.setdefault(figure, []).append(median["B"] / median["A"])
        said = "; ".join(f"{figure} A {m['A']:.2f} ms, B {m['B']:.2f} ms" for figure, m in medians.items())
        print(f"round {n + 1}/{rounds} ({' then '.join(order)}): {said}", flush=True)
    return taken, by_round


def beside(name: str, values: list[float], baseline: list[float] | None = None) -> list[str]:
    line = row(name, values, "ms", baseline)
    if baseline:  # to the third decimal: the differences looked for here are a few percent
        line[4] = f"{statistics.median(values) / statistics.median(baseline):.3f}x"
    return line


def judged(title: str, taken: dict[str, tuple[list[float], list[float]]], by_round: list[float]) -> None:
    """Print one figure of both trees, by position too, and how likely B's count of quicker rounds is by chance."""
    a, b = (taken[label][0] + taken[label][1] for label in ("A", "B"))
    print_table(
        title,
        [
            beside("A", a),
            beside("B (vs A)", b, a),
            beside("  A, measured first", taken["A"][0]),
            beside("  B, measured second (vs A first)", taken["B"][1], taken["A"][0]),
            beside("  B, measured first", taken["B"][0]),
            beside("  A, measured second (vs B first)", taken["A"][1], taken["B"][0]),
        ],
    )
    quicker = sum(ratio < 1 for ratio in by_round)
    print(
        f"\nB/A: {statistics.median(b) / statistics.median(a):.3f} over all, {quartile(b) / quartile(a):.3f} at their "
        f"first quartile (the runs least slowed by the machine's other work); round by round median "
        f"{statistics.median(by_round):.3f} (from {min(by_round):.3f} to {max(by_round):.3f}), B quicker in "
        f"{quicker} of {len(by_round)} rounds (as likely as that or further from half by chance alone: "
        f"{sign_test(quicker, len(by_round)):.2g})"
    )


def quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0]


def sign_test(k: int, n: int) -> float:
    """The chance that a fair coin, tossed ``n`` times, lands heads as far from ``n / 2`` as ``k``
    is, or further (two-sided): below 0.05 or so, B's being quicker in ``k`` of ``n`` rounds is
    not the machine's noise."""
    far = abs(k - n / 2)
    return min(1.0, sum(math.comb(n, i) for i in range(n + 1) if abs(i - n / 2) >= far) / 2**n)


if __name__ == "__main__":
    main()
