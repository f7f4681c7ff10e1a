"""jacmem.walker: the one walk of autograd's graph, on small graphs whose nodes are known
by construction (branches, a shared node, AccumulateGrad leaves, a stop rule, a limit)."""

import torch
from torch import nn

from jacmem import walker


def names(fns) -> list[str]:
    return [fn.name() for fn in fns]


def test_children_and_edges_leave_out_inputs_that_need_no_gradient():
    a = torch.randn(3, requires_grad=True)
    y = a * torch.randn(3)  # the constant's edge is None
    assert [fn.name() for fn, _ in y.grad_fn.next_functions if fn is not None] == ["torch::autograd::AccumulateGrad"]
    assert len(y.grad_fn.next_functions) == 2
    assert names(walker.children(y.grad_fn)) == ["torch::autograd::AccumulateGrad"]
    assert [nr for _, nr in walker.edges(y.grad_fn)] == [0]
    assert walker.leaf(walker.children(y.grad_fn)[0]) is a
    assert walker.leaf(y.grad_fn) is None


def test_a_shared_node_is_visited_once_and_every_branch_is_walked():
    a = torch.randn(3, requires_grad=True)
    h = a.exp()  # shared by both branches
    y = h.sin() + h.cos()
    seen = list(walker.Walk([y.grad_fn]))
    assert len(seen) == len(set(seen)) == 5  # add, sin, cos, exp, a's AccumulateGrad
    assert sorted(names(seen)) == sorted(
        ["AddBackward0", "SinBackward0", "CosBackward0", "ExpBackward0", "torch::autograd::AccumulateGrad"]
    )
    # depth first: a node's subgraph before its siblings; breadth first: by distance from the root
    assert names(walker.Walk([y.grad_fn], breadth=True))[:3] == ["AddBackward0", "SinBackward0", "CosBackward0"]
    depth = names(walker.Walk([y.grad_fn]))
    assert depth[:3] == ["AddBackward0", "CosBackward0", "ExpBackward0"]


def test_parameters_are_the_reached_accumulate_grad_leaves_of_parameter_type():
    w, v, frozen = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    frozen.requires_grad_(False)
    plain = torch.randn(3, requires_grad=True)  # a leaf, but no nn.Parameter
    y = (w * w).sum() + (plain * frozen).sum()
    z = (v * 2).sum()
    assert [id(p) for p in walker.parameters(y)] == [id(w)]  # w once, though used twice
    assert {id(p) for p in walker.parameters([y, z, torch.ones(1)])} == {id(w), id(v)}
    assert walker.parameters(torch.ones(2)) == []
    assert walker.parameters(w) == []  # a leaf has no graph


def test_step_stops_the_walk_below_an_item_and_carries_state_along_paths():
    a = torch.randn(3, requires_grad=True)
    h = a.exp()
    y = h.sin().sum()
    stop = h.grad_fn

    def step(fn):
        return [] if fn is stop else walker.children(fn)

    assert names(walker.Walk([y.grad_fn], step)) == ["SumBackward0", "SinBackward0", "ExpBackward0"]

    # (node, depth) items: each pair once; keyed on the node, each node once
    def deeper(item):
        fn, d = item
        return [(c, d + 1) for c in walker.children(fn)]

    x = a.exp()
    two = x + x  # both edges of the addition lead to the same node
    items = list(walker.Walk([(two.grad_fn, 0)], deeper))
    assert [d for _, d in items] == [0, 1, 2]
    assert len(list(walker.Walk([(two.grad_fn, 0)], deeper, key=lambda item: item[0]))) == 3


def test_only_asks_step_about_the_named_node_types_and_carries_the_rest_on():
    a = torch.randn(3, requires_grad=True)
    y = ((a.exp() + 1).sin() * 2).sum()  # Sum, Mul, Sin, Add, Exp, AccumulateGrad
    asked = []

    def step(item):
        fn, flag = item
        asked.append(fn.name())
        return [(c, True) for c in walker.children(fn)]  # sets the flag below it

    items = list(walker.Walk([(y.grad_fn, False)], step, only={"AddBackward", "MulBackward"}))
    assert asked == ["MulBackward0", "AddBackward0"], "only the named types, digits left off"
    assert [(fn.name(), flag) for fn, flag in items] == [
        ("SumBackward0", False),
        ("MulBackward0", False),
        ("SinBackward0", True),  # carried from Mul's step
        ("AddBackward0", True),
        ("ExpBackward0", True),
        ("torch::autograd::AccumulateGrad", True),
    ]


def test_limit_cuts_the_walk_and_says_so():
    a = torch.randn(3, requires_grad=True)
    y = a
    for _ in range(10):
        y = y * 2
    walk = walker.Walk([y.grad_fn], limit=4)
    assert len(list(walk)) == len(walk.items) == 4 and walk.cut
    assert not walker.Walk([y.grad_fn], limit=11).cut  # ten products and a's AccumulateGrad
    assert walker.Walk([y.grad_fn], limit=10).cut


def test_none_starts_and_tensors_without_a_graph_are_skipped():
    a = torch.randn(3, requires_grad=True)
    y = a.exp()
    assert walker.roots([y, torch.ones(1), a, "text"]) == [y.grad_fn]
    assert walker.roots(y) == [y.grad_fn]
    assert names(walker.Walk([None, y.grad_fn])) == ["ExpBackward0", "torch::autograd::AccumulateGrad"]
