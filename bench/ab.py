"""The per-call figure of two source trees, A/B by turns in one process: whether a hot-path change
helps, on a machine whose spells move every figure more than the change does.

    python bench/ab.py <other-tree> [--rounds 8] [--calls 40] [--billed]

A is this tree, B the other (a `git worktree` of another commit, say), each run as its own stack
(web, one exec and one tools worker, its own database and Redis prefix) with this interpreter. Each
round runs one job of ``--calls`` sequential `Demo.echo` (`Demo.add` with ``--billed``) on each
stack, A first in even rounds and B first in odd ones: the one measured second has been ~3.5%
quicker with the same code, so each tree is taken as often in either place. Prints the medians and
p95 of each, their ratio, the same by position, and the ratio round by round, with how likely
B's count of quicker rounds is by chance. Many short rounds judge best on a busy machine: a pair of
jobs measured close together shares its spell (``--rounds 150 --calls 20`` takes a minute).
"""

import argparse
import math
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import harness
from harness import print_table, row, run_job, running_stack
from spine import PER_CALL, PER_CALL_BILLED, STACK_ENV

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
    parser.add_argument("--billed", action="store_true", help="Demo.add (its price held, then settled) for Demo.echo")
    args = parser.parse_args()
    trees = {"A": harness.ROOT, "B": args.other.resolve()}
    if not (trees["B"] / "manage.py").is_file():
        sys.exit(f"{trees['B']} is not a source tree of this project (no manage.py)")
    job = (PER_CALL_BILLED if args.billed else PER_CALL).replace("N", str(args.calls))

    with ExitStack() as stacks:
        clients = {}
        for label, tree in trees.items():
            rooted(tree)
            _, clients[label] = stacks.enter_context(running_stack(STACK_ENV, name=f"ab-{label}"))
        rooted(trees["A"])
        for client in clients.values():  # the first job on fresh workers pays their connections
            run_job(client, job)
        # taken[label][position]: the calls' ms of each tree, measured first (0) or second (1)
        taken: dict[str, tuple[list[float], list[float]]] = {"A": ([], []), "B": ([], [])}
        by_round = []
        for n in range(args.rounds):
            order = ("A", "B") if n % 2 == 0 else ("B", "A")
            medians = {}
            for position, label in enumerate(order):
                samples = run_job(clients[label], job)["return_value"]
                taken[label][position].extend(samples)
                medians[label] = statistics.median(samples)
            by_round.append(medians["B"] / medians["A"])
            print(
                f"round {n + 1}/{args.rounds} ({' then '.join(order)}): A {medians['A']:.2f} ms, B {medians['B']:.2f} ms",
                flush=True,
            )

    a, b = (taken[label][0] + taken[label][1] for label in ("A", "B"))

    def beside(name: str, values: list[float], baseline: list[float] | None = None) -> list[str]:
        line = row(name, values, "ms", baseline)
        if baseline:  # to the third decimal: the differences looked for here are a few percent
            line[4] = f"{statistics.median(values) / statistics.median(baseline):.3f}x"
        return line

    tool = "Demo.add" if args.billed else "Demo.echo"
    print_table(
        f"Per call, sequential {tool}: A {trees['A']}, B {trees['B']}; {args.rounds} rounds of {args.calls} by turns",
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
        f"\nB/A: {statistics.median(b) / statistics.median(a):.3f} over all calls, {quartile(b) / quartile(a):.3f} at their "
        f"first quartile (the calls least slowed by the machine's other work); round by round median "
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
