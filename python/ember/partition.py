"""Graphs with ops Ember does not support: the supported regions compiled, the rest eager.

``torch.export`` lowers the graph to ATen, the level Ember's PT2 frontend reads, so support is
decided per ATen node by the frontend's own op table (``_core.pt2_supports``). torch's
capability-based partitioner groups the supported nodes into regions (never a region that
needs its own output back through an eager op); each region becomes a small graph module that
Ember compiles on its first call, and everything else (the unsupported ops, the export's input
guards) runs eagerly around them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from ember import _core
from ember.errors import InputError
from ember.export import export_program

REGION_PREFIX = "ember_region_"


def target_name(target: Any) -> str:
    """An FX call target as the PT2 archive spells it (``torch.ops.aten.add.Tensor``,
    ``_operator.mul``)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target}"  # str() is "namespace.name.overload"
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if module and name:
        return f"{module}.{name}"
    return str(target)


def _short(name: str) -> str:
    return name.removeprefix("torch.ops.")


class _EmberSupport(OperatorSupportBase):
    """A node is supported when Ember translates its op; ``getitem`` follows its producer
    (multi-output ops are one node in the archive)."""

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            producer = node.args[0]
            return isinstance(producer, torch.fx.Node) and self.is_node_supported(
                submodules, producer
            )
        return _core.pt2_supports(target_name(node.target))


def _is_bookkeeping(node: torch.fx.Node) -> bool:
    """Nodes that compute nothing on their own: a region of only these is not worth a
    compiled program."""
    name = target_name(node.target)
    return (
        node.target is operator.getitem
        or name.startswith(("_operator.", "torch.sym_", "torch.ops.aten.sym_"))
        or name.startswith("torch.ops.aten.size")
    )


def _worth_compiling(partition: Partition) -> bool:
    return any(not _is_bookkeeping(node) for node in partition.nodes)


class _Guards(torch.nn.Module):
    """The export's input checks (sizes it specialized on). A failed check is an
    ``InputError``, which makes the caller specialize for the new sizes."""

    def __init__(self, guards: torch.nn.Module) -> None:
        super().__init__()
        self.guards = guards

    def forward(self, *args: Any) -> None:
        try:
            self.guards(*args)
        except AssertionError as e:
            raise InputError(f"inputs outside the exported graph's assumptions: {e}") from e


class _Region(torch.nn.Module):
    """A compiled region in the eager graph (``call_module`` needs a module). Its graph
    returns a tuple, compiled or run eagerly; a region with one output returns it bare."""

    def __init__(self, run: Callable[..., Any], single_output: bool) -> None:
        super().__init__()
        self.run = run
        self.single_output = single_output

    def forward(self, *args: Any) -> Any:
        out = self.run(*args)
        return out[0] if self.single_output else out


class Partitioned(NamedTuple):
    module: torch.fx.GraphModule  # flat inputs → flat outputs: eager ops and regions
    unsupported: list[str]  # the ops that run eagerly, e.g. "ember_test.mystery.default"
    regions: int  # how many regions Ember compiles


def _flat_module(unlifted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The unlifted program's graph with plain calling conventions (flat arguments in, a
    tuple of flat outputs back) instead of its pytree flatten/unflatten wrapper."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(unlifted.graph, env)
    graph.output(tuple(out) if isinstance(out, list | tuple) else (out,))
    module = torch.fx.GraphModule(unlifted, graph)
    guards = getattr(module, "_guards_fn", None)
    if isinstance(guards, torch.nn.Module):
        module._guards_fn = _Guards(guards)
    return module


def _move_weights_into(
    parent: torch.fx.GraphModule, call: torch.fx.Node, region: torch.fx.GraphModule
) -> None:
    """Weights the parent passes to ``region`` become the region's own attributes, so Ember
    compiles them in (pre-packed, folded) instead of reading them as inputs on every call."""
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    kept_args = []
    for arg, placeholder in zip(call.args, placeholders, strict=True):
        value: Any = None
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value = parent
            for part in str(arg.target).split("."):
                value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            kept_args.append(arg)
            continue
        attr_name = f"weight_{placeholder.name}"
        if isinstance(value, torch.nn.Parameter):
            region.register_parameter(attr_name, value)
        else:
            region.register_buffer(attr_name, value)
        with region.graph.inserting_after(placeholders[-1]):
            attr = region.graph.get_attr(attr_name)
        attr.meta = dict(placeholder.meta)
        placeholder.replace_all_uses_with(attr)
        region.graph.erase_node(placeholder)
    call.args = tuple(kept_args)
    region.recompile()
    parent.recompile()


def partition(
    gm: torch.fx.GraphModule,
    args: Sequence[Any],
    dynamic_shapes: Any,
    compile_region: Callable[[torch.fx.GraphModule], Callable[..., Any]],
) -> Partitioned:
    """Exports ``gm(*args)`` and splits it into regions Ember compiles (each handed to
    ``compile_region``, which returns what runs it) and eager ops around them."""
    ep = export_program(gm, args, dynamic_shapes=dynamic_shapes)
    module = _flat_module(ep.module())
    support = _EmberSupport()
    unsupported = sorted(
        {
            _short(target_name(node.target))
            for node in module.graph.nodes
            if node.op == "call_function"
            and node.target is not operator.getitem  # follows its producer, named already
            and not support.is_node_supported({}, node)
        }
    )
    partitioner = CapabilityBasedPartitioner(module, support, allows_single_node_partition=True)
    partitions = [p for p in partitioner.propose_partitions() if _worth_compiling(p)]
    module = partitioner.fuse_partitions(partitions, prefix=REGION_PREFIX)
    calls = {
        node.target: node
        for node in module.graph.nodes
        if node.op == "call_module" and str(node.target).startswith(REGION_PREFIX)
    }
    regions = 0
    for name, sub in list(module.named_children()):
        if name not in calls or not isinstance(sub, torch.fx.GraphModule):
            continue
        _move_weights_into(module, calls[name], sub)
        # Region graphs carry the export's fake values as "val"; the Dynamo-graph tools
        # that compile them read Dynamo's name for it.
        for node in sub.graph.nodes:
            if "val" in node.meta:
                node.meta.setdefault("example_value", node.meta["val"])
        (output,) = [node for node in sub.graph.nodes if node.op == "output"]
        single = not isinstance(output.args[0], tuple | list)
        if single:
            # A region returns a tuple however it runs: compiled, or its own graph eagerly
            # when Ember refuses an op's arguments (`_Region` unwraps the one output).
            output.args = ((output.args[0],),)
            sub.recompile()
        setattr(module, name, _Region(compile_region(sub), single))
        regions += 1
    return Partitioned(module, unsupported, regions)
