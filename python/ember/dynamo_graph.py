"""Dynamo graphs rewritten into what ``torch.export`` and Ember take whole.

Dynamo's graphs carry sizes as values: each symbolic size it lifts becomes an int input of
its own next to the tensors whose shapes hold it, and a graph may return sizes (a cache's new
length) and constants next to its tensors. Exported as they are, such an int input becomes a
symbol tied to nothing, which Ember (whose programs take tensors and read every size from
their shapes) cannot tell the value of, so every new size would compile a new program.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

_aten = torch.ops.aten
_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_number(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("example_value"), _NUMBERS)


class DynamoGraph(NamedTuple):
    """A Dynamo graph split for export (see ``split``)."""

    gm: torch.fx.GraphModule  # what is exported: tensors in, tensors out
    kept: list[int]  # positions of the call arguments ``gm`` takes
    sizes: torch.fx.GraphModule | None  # the size outputs, run in Python on all arguments
    outputs: list[tuple[str, Any]]  # per output leaf: (kind, size index or constant)
    out_spec: Any  # the original output structure

    def exports_everything(self) -> bool:
        return all(kind == "tensor" for kind, _ in self.outputs)

    def rebuild(self, args: Sequence[Any], flat: Sequence[torch.Tensor]) -> Any:
        """The original graph's outputs, from the exported graph's tensors and the call's
        arguments (for the sizes)."""
        sizes = self.sizes(*args) if self.sizes is not None else ()
        it = iter(flat)
        leaves = []
        for kind, value in self.outputs:
            if kind == "tensor":
                leaves.append(next(it))
            elif kind == "scalar":
                leaves.append(next(it).item())
            elif kind == "size":
                leaves.append(sizes[value])
            else:
                leaves.append(value)
        return pytree.tree_unflatten(leaves, self.out_spec)


def split(gm: torch.fx.GraphModule) -> DynamoGraph:
    """Rewrites a Dynamo graph on copies (parameters shared; the original stays as it is, for
    eager fallback):

    * every int input equal to some tensor input's dim becomes ``aten.sym_size.int(tensor,
      dim)``, so the size is one symbol, read from the tensor;
    * outputs that are sizes computed from the inputs' sizes and int inputs alone are left to
      a small Python graph run on the arguments (``sizes``); int inputs nothing else uses are
      then dropped;
    * other number outputs are returned as 0-d tensors (``scalar``), constants put back.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    leaves, out_spec = pytree.tree_flatten(output.args[0])

    # Size arithmetic on inputs alone (`s0 + 1`, `x.size(2)`), computable in Python.
    size_nodes: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if (
            node.op in ("call_function", "call_method")
            and _is_number(node)
            and all(i.op == "placeholder" or i in size_nodes for i in node.all_input_nodes)
        ):
            size_nodes.add(node)
    size_leaves = [
        leaf
        for leaf in leaves
        if isinstance(leaf, torch.fx.Node)
        and (leaf in size_nodes or (leaf.op == "placeholder" and _is_number(leaf)))
    ]
    sizes = _sizes_graph(gm, size_leaves) if size_leaves else None

    # Tensor dims that carry each size symbol.
    dims: dict[Any, tuple[torch.fx.Node, int]] = {}
    for node in placeholders:
        example = node.meta.get("example_value")
        if isinstance(example, torch.Tensor):
            for i, size in enumerate(example.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (node, i))

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in placeholders:
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.sym_sum:
            env[node] = _sum_as_adds(graph, node, env)
        elif node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    outputs: list[tuple[str, Any]] = []
    results: list[torch.fx.Node] = []
    for leaf in leaves:
        if leaf in size_leaves:
            outputs.append(("size", size_leaves.index(leaf)))
        elif _is_number(leaf):
            example = leaf.meta["example_value"]
            if isinstance(example, bool | torch.SymBool):
                dtype = torch.bool
            elif isinstance(example, float | torch.SymFloat):
                dtype = torch.float64
            else:
                dtype = torch.int64
            outputs.append(("scalar", None))
            results.append(
                graph.call_function(_aten.scalar_tensor.default, (env[leaf],), {"dtype": dtype})
            )
        elif isinstance(leaf, torch.fx.Node):
            outputs.append(("tensor", None))
            results.append(env[leaf])
        else:
            outputs.append(("const", leaf))
    graph.output(tuple(results))

    # Size nodes whose only use was an output computed in Python now have no users.
    for node in reversed(list(gm.graph.nodes)):
        if node in size_nodes and not env[node].users:
            graph.erase_node(env[node])
    kept = []
    for i, node in enumerate(placeholders):
        copy = env[node]
        example = node.meta.get("example_value")
        if isinstance(example, _NUMBERS) and not copy.users:
            graph.erase_node(copy)
            continue
        if isinstance(example, torch.SymInt) and example.node.expr in dims:
            tensor, dim = dims[example.node.expr]
            with graph.inserting_before(_first_non_placeholder(graph)):
                size = graph.call_function(_aten.sym_size.int, (env[tensor], dim))
            size.meta = dict(copy.meta)
            copy.replace_all_uses_with(size)
            graph.erase_node(copy)
            continue
        kept.append(i)
    # Tensor inputs the graph does not read (weights bound as constants, see
    # `with_constants`) are not exported.
    for i in list(kept):
        copy = env[placeholders[i]]
        if not copy.users and isinstance(placeholders[i].meta.get("example_value"), torch.Tensor):
            graph.erase_node(copy)
            kept.remove(i)
    graph.lint()
    return DynamoGraph(torch.fx.GraphModule(gm, graph), kept, sizes, outputs, out_spec)


def _sum_as_adds(
    graph: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]
) -> torch.fx.Node:
    """``torch.sym_sum([a, b, c])`` (which torch.export cannot serialize) as ``a + b + c``."""
    terms = [env[t] if isinstance(t, torch.fx.Node) else t for t in node.args[0]] or [0]
    total: Any = terms[0]
    for term in terms[1:]:
        total = graph.call_function(operator.add, (total, term))
        total.meta = dict(node.meta)
    if not isinstance(total, torch.fx.Node):  # all constants
        total = graph.call_function(operator.add, (total, 0))
        total.meta = dict(node.meta)
    return total


def _first_non_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")


def _sizes_graph(gm: torch.fx.GraphModule, leaves: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A graph over all of ``gm``'s arguments that computes just ``leaves``."""
    needed: set[torch.fx.Node] = set()
    stack = list(leaves)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[leaf] for leaf in leaves))
    return torch.fx.GraphModule(gm, graph)


def lifted_scalars(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the inputs Dynamo lifted from Python floats (with ``dynamic=True``, a
    module attribute such as a norm's ``eps`` arrives as a 0-d tensor read by ``.item()``).
    Ember's ops take such values as constants, so the graph is specialized on them."""
    positions = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        example = node.meta.get("example_value")
        if (
            isinstance(example, torch.Tensor)
            and example.dim() == 0
            and node.users
            and all(u.op == "call_method" and u.target == "item" for u in node.users)
        ):
            positions.append(i)
    return positions


def weight_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the inputs that are module parameters and buffers (Dynamo passes them as
    graph inputs). Ember binds them as weights: compiled in (pre-packed, folded), not read
    on every call."""
    positions = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "")
        source = source() if callable(source) else source
        if isinstance(source, str) and ("._parameters[" in source or "._buffers[" in source):
            positions.append(i)
    return positions


def with_constants(
    gm: torch.fx.GraphModule, scalars: dict[int, Any], weights: dict[int, torch.Tensor]
) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which each ``.item()`` of input ``i`` is the constant
    ``scalars[i]`` and input ``j`` is the module attribute ``weights[j]`` (a parameter or
    buffer of the copy, which ``torch.export`` lifts as a weight). The inputs stay in the
    signature, unread."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    read = {
        user: value
        for i, value in scalars.items()
        for user in placeholders[i].users  # the `.item()` calls
    }
    for node in gm.graph.nodes:
        env[node] = read[node] if node in read else graph.node_copy(node, lambda n: env[n])
    # Attributes by qualified name: the graph's own (constants, submodules) and the weights.
    attrs: dict[str, Any] = {
        node.target: _attribute(gm, node.target)
        for node in gm.graph.nodes
        if node.op in ("get_attr", "call_module") and isinstance(node.target, str)
    }
    with graph.inserting_before(_first_non_placeholder(graph)):
        for i, tensor in weights.items():
            name = f"ember_weight_{i}"
            attrs[name] = tensor  # a Parameter stays one; export lifts both kinds as weights
            attr = graph.get_attr(name)
            attr.meta = dict(placeholders[i].meta)
            env[placeholders[i]].replace_all_uses_with(attr)
    module = torch.fx.GraphModule(attrs, graph)
    module.train(gm.training)
    return module


def _attribute(module: torch.nn.Module, qualified: str) -> Any:
    value: Any = module
    for part in qualified.split("."):
        value = getattr(value, part)
    return value
