"""Chaos for a run tree: the root cancelled while a parallel group and two child runs are in
flight, with and without a SIGKILL of the worker right after the cancel; and a grandchild's
group under a child (tests/chaos/tree.py). Nothing stranded, nothing called after the cancel."""

from __future__ import annotations

from tests.chaos.harness import Stack
from tests.chaos.tree import check_tree, tree_rounds


async def test_a_root_cancelled_during_a_group_and_two_children_leaves_nothing_stranded(stack: Stack) -> None:
    results = await tree_rounds(stack.client, stack.server.address, stack.billing, stack.workdir)
    assert [(r.shape, r.kill) for r in results] == [("group", False), ("group", True), ("nested", True)]
    for result in results:
        check_tree(result)
