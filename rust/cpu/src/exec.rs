//! Running a program: caller inputs become values (read in place), nodes (or fused groups)
//! run in order, buffers go back to the call's arena after their last use for later nodes to
//! reuse, and fresh results that are graph outputs are written straight into the caller's
//! buffers (other outputs are copied there at the end).

use std::sync::Arc;

use ember_core::dtype::DType;
use ember_core::ir::{Node, Op};
use ember_core::tensor::{TensorOut, TensorView};
use ember_core::{Error, Result};

use crate::arena::{Arena, Dest};
use crate::buffer::{is_aligned, Layout, Storage, Val};
use crate::compile::{Plan, Program, KERNEL_PACKED, KERNEL_ROWWISE};
use crate::error::{CpuError, KResult};
use crate::fuse::{dot_in_place, Role};
use crate::kernels::sgemm::Packed;
use crate::kernels::{
    attention, conv, dot, elementwise as ew, fused, index, integer_dot, movement as mv, norm, pool,
    reduce,
};
use crate::profile;
use crate::strided::map1;

/// A caller's input as a value. The view's memory is trusted (the `run` contract); its
/// layout is what every later bounds check measures against.
///
/// # Safety
/// `v` must be valid for reads over its shape and strides for the whole call.
pub unsafe fn input_val(v: &TensorView, dtype: DType, k: usize) -> Result<Val> {
    if v.dtype != dtype || v.strides.len() != v.shape.len() {
        return Err(Error::Input(format!(
            "input {k} is {}{:?} with {} strides, the program expects {dtype}",
            v.dtype,
            v.shape,
            v.strides.len()
        )));
    }
    let mut layout = Layout {
        shape: v.shape.clone(),
        strides: v.strides.iter().map(|&s| s as isize).collect(),
        offset: 0,
    };
    let size = dtype.size();
    let storage = match layout.extent() {
        None => Storage::zeroed(0),
        Some((lo, hi)) if lo < 0 => {
            return Err(Error::Input(format!(
                "input {k} has strides reaching below its start ({lo}..={hi})"
            )))
        }
        Some((_, hi)) => {
            let bytes = (hi as usize + 1) * size;
            if is_aligned(v.ptr, size) {
                Storage::External { ptr: v.ptr, bytes }
            } else {
                // SAFETY: the caller guarantees these bytes are readable (run's contract).
                Storage::copy_of(unsafe { std::slice::from_raw_parts(v.ptr, bytes) })
            }
        }
    };
    if storage.bytes() == 0 {
        layout.offset = 0;
    }
    Val::new(dtype, Arc::new(storage), layout).map_err(Error::from)
}

/// Writes `val` into the caller's contiguous output.
///
/// # Safety
/// `out` must be valid for writes of its full size and not alias any input.
pub unsafe fn write_output(val: &Val, out: &TensorOut, k: usize) -> Result<()> {
    if out.dtype != val.dtype || out.shape != val.shape() {
        return Err(Error::Input(format!(
            "output {k} is {}{:?}, the program produces {}{:?}",
            out.dtype,
            out.shape,
            val.dtype,
            val.shape()
        )));
    }
    let n = val.numel();
    let written_in_place = std::ptr::eq(val.storage.ptr(), out.ptr)
        && val.layout.offset == 0
        && val.layout.is_contiguous();
    if n == 0 || written_in_place {
        return Ok(());
    }
    let size = val.dtype.size();
    if is_aligned(out.ptr, size) {
        crate::with_size!(val.dtype, U => {
            let v = val.view::<U>()?;
            // SAFETY: the caller guarantees `n` writable, aligned (checked) elements.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr as *mut U, n) };
            map1(&v, dst, |x| x);
        });
    } else {
        let c = val.contiguous()?;
        let src = c
            .storage
            .ptr()
            .wrapping_add(c.layout.offset as usize * size);
        // SAFETY: `c` is contiguous with `n` elements from its offset; `out` holds n·size bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, out.ptr, n * size) };
    }
    Ok(())
}

/// Runs every node; returns the values of the graph's outputs (some of them already written
/// into `outputs`, which must be valid for writes and alias no input: `run`'s contract).
pub fn execute(
    prog: &Program,
    plan: &Arc<Plan>,
    inputs: Vec<Val>,
    outputs: &[TensorOut],
    threads: usize,
    arena: &mut Arena,
) -> Result<Vec<Val>> {
    let g = &prog.graph;
    let mut vals = arena.values_for(plan);
    let mut inputs: Vec<Option<Val>> = inputs.into_iter().map(Some).collect();
    // The caller buffer each output node may write into (its first place among the outputs).
    let mut direct: Vec<Option<*mut u8>> = vec![None; g.nodes.len()];
    for (out, &o) in outputs.iter().zip(&g.outputs).rev() {
        direct[o] = Some(out.ptr);
    }
    for (id, node) in g.nodes.iter().enumerate() {
        if plan.fixed[id].is_some() {
            continue;
        }
        let started = profile::start();
        let val = match (prog.fusion.role[id], &node.op) {
            (Role::Member(_), _) => continue,
            (_, Op::Input { index }) => inputs
                .get_mut(*index)
                .and_then(Option::take)
                .ok_or_else(|| Error::Input(format!("input {index} is missing or used twice")))?,
            (Role::Root(k), _) => run_group(prog, plan, k, &vals, direct[id], arena, threads)
                .map_err(|e| e.at_node(&node.op.name(), &node.origin))?,
            (Role::Plain, Op::Dot) if dot_in_place(node.ty.dtype) => {
                run_dot(prog, plan, id, node, &vals, direct[id], arena, threads)
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, Op::IntegerDot) => {
                run_integer_dot(prog, plan, id, node, &vals, direct[id], arena, threads)
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, Op::Concat { axis }) => {
                let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct[id]);
                node.inputs
                    .iter()
                    .map(|&i| value(&vals, i))
                    .collect::<KResult<Vec<&Val>>>()
                    .and_then(|xs| mv::concat_into(&xs, *axis, &mut dest))
                    .and_then(|()| dest.finish())
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, Op::CacheAppend { axis, .. }) => {
                let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct[id]);
                let arg = |k: usize| value(&vals, node.inputs[k]);
                arg(0)
                    .and_then(|past| {
                        mv::cache_append_into(past, arg(1)?, arg(2)?, *axis, &mut dest)
                    })
                    .and_then(|()| dest.finish())
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, Op::Conv { .. }) if conv::conv_in_place(node.ty.dtype) => {
                let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct[id]);
                conv_into(node, &prog.packed[id], &vals, &mut dest, None, threads)
                    .and_then(|()| dest.finish())
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, Op::Pool { .. }) if pool::pool_in_place(node.ty.dtype) => {
                let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct[id]);
                value(&vals, node.inputs[0])
                    .and_then(|x| pool::pool_into(x, &pool_params(&node.op)?, &mut dest))
                    .and_then(|()| dest.finish())
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            (Role::Plain, op) if writes_rows_into(op, plan.shapes[id].len()) => {
                let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct[id]);
                rows_into(node, &vals, &mut dest)
                    .and_then(|()| dest.finish())
                    .map_err(|e| e.at_node(&node.op.name(), &node.origin))?
            }
            _ => eval(prog, plan, id, node, &vals, threads)
                .map_err(|e| e.at_node(&node.op.name(), &node.origin))?,
        };
        if val.shape() != plan.shapes[id].as_slice() || val.dtype != node.ty.dtype {
            return Err(CpuError::Internal(format!(
                "produced {}{:?}, expected {}{:?}",
                val.dtype,
                val.shape(),
                node.ty.dtype,
                plan.shapes[id]
            ))
            .at_node(&node.op.name(), &node.origin));
        }
        if !matches!(node.op, Op::Input { .. }) {
            profile::record(started, || step_label(prog, id), &plan.shapes[id]);
        }
        vals[id] = Some(val);
        for &i in &prog.reads[id] {
            if prog.last_use[i] == id && plan.fixed[i].is_none() {
                if let Some(v) = vals[i].take() {
                    arena.give(v);
                }
            }
        }
    }
    let results = g
        .outputs
        .iter()
        .map(|&o| {
            vals[o]
                .clone()
                .ok_or_else(|| Error::Runtime(format!("output %{o} was freed")))
        })
        .collect();
    arena.keep_values(plan, vals);
    results
}

/// What a profile calls step `id`: its op, or the kind of fused group it ends.
fn step_label(prog: &Program, id: usize) -> String {
    match prog.fusion.role[id] {
        Role::Root(k) => {
            let grp = &prog.fusion.groups[k];
            let ops = grp.steps.len();
            match &grp.head {
                Some(h) => format!(
                    "fused {} + {ops} elementwise",
                    prog.graph.nodes[h.dot].op.name()
                ),
                // A group of one op is that op (`round`, `cast`), unfused.
                None if ops == 1 => prog.graph.nodes[grp.root].op.name(),
                None => format!("fused {ops} elementwise"),
            }
        }
        _ => prog.graph.nodes[id].op.name(),
    }
}

fn value(vals: &[Option<Val>], i: usize) -> KResult<&Val> {
    vals[i]
        .as_ref()
        .ok_or_else(|| CpuError::Internal(format!("value %{i} is gone")))
}

/// A pooling node's window (the op must be `Op::Pool`).
fn pool_params(op: &Op) -> KResult<pool::Params<'_>> {
    match op {
        Op::Pool {
            kind,
            kernel,
            stride,
            padding,
            dilation,
            ..
        } => Ok(pool::Params {
            kind: *kind,
            kernel,
            stride,
            padding,
            dilation,
        }),
        op => Err(CpuError::Internal(format!("{} is not a pool", op.name()))),
    }
}

/// Row-wise kernels that write a contiguous result of their input's shape into an arena
/// buffer (no fresh zeroed allocation, and page faults, per call): the norms, and softmax
/// over the last axis.
fn writes_rows_into(op: &Op, rank: usize) -> bool {
    match op {
        Op::Softmax { axis, .. } => *axis + 1 == rank,
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => true,
        _ => false,
    }
}

fn rows_into(node: &Node, vals: &[Option<Val>], dest: &mut Dest) -> KResult<()> {
    let x = value(vals, node.inputs[0])?;
    match &node.op {
        Op::Softmax { log, .. } => norm::softmax_last_into(x, *log, dest),
        Op::LayerNorm { axis, eps, .. } => {
            norm::layer_norm_into(x, *axis, *eps, norm_params(node, vals)?, dest)
        }
        Op::RmsNorm { axis, eps, .. } => {
            norm::rms_norm_into(x, *axis, *eps, norm_params(node, vals)?.0, dest)
        }
        op => Err(CpuError::Internal(format!("{} is not row-wise", op.name()))),
    }
}

/// A norm's weight and bias (inputs 1 and 2 when present).
fn norm_params<'v>(
    node: &Node,
    vals: &'v [Option<Val>],
) -> KResult<(Option<&'v Val>, Option<&'v Val>)> {
    let (has_weight, has_bias) = match node.op {
        Op::LayerNorm {
            has_weight,
            has_bias,
            ..
        } => (has_weight, has_bias),
        Op::RmsNorm { has_weight, .. } => (has_weight, false),
        _ => (false, false),
    };
    let arg = |k: usize| value(vals, node.inputs[k]).map(Some);
    let w = if has_weight { arg(1)? } else { None };
    let b = if has_bias {
        arg(1 + has_weight as usize)?
    } else {
        None
    };
    Ok((w, b))
}

/// A fused group: its head's product first (into the output), then the blocked pass.
fn run_group(
    prog: &Program,
    plan: &Plan,
    k: usize,
    vals: &[Option<Val>],
    direct: Option<*mut u8>,
    arena: &mut Arena,
    threads: usize,
) -> KResult<Val> {
    let g = &prog.graph;
    let grp = &prog.fusion.groups[k];
    let root = grp.root;
    let mut dest = arena.dest(g.nodes[root].ty.dtype, &plan.shapes[root], direct);
    let head_leaf = grp.head.as_ref().map(|h| h.leaf);
    let leaves = grp
        .leaves
        .iter()
        .map(|&l| {
            if Some(l) == head_leaf {
                Ok(None)
            } else {
                value(vals, l).map(Some)
            }
        })
        .collect::<KResult<Vec<_>>>()?;
    let head = match &grp.head {
        Some(_) => Some(dest.peek()?),
        None => None,
    };
    // Prepared before the head is written (it only records where things are), so that a
    // conv can run it on each image's outputs as soon as they are written.
    let pass = fused::Pass::new(g, grp, &leaves, head.as_ref(), &mut dest)?;
    match &grp.head {
        Some(h) => {
            let d = &g.nodes[h.dot];
            match &d.op {
                Op::Conv { .. } => conv_into(
                    d,
                    &prog.packed[h.dot],
                    vals,
                    &mut dest,
                    Some(&pass),
                    threads,
                )?,
                _ => {
                    dot_into(prog, h.dot, d, vals, &mut dest, threads)?;
                    pass.all()?
                }
            }
        }
        None => pass.all()?,
    }
    drop(pass);
    drop(head);
    dest.finish()
}

/// A conv node written into `dest` (`packed`: its weight per group, when packed), then
/// `epilogue` over it.
fn conv_into(
    node: &Node,
    packed: &[Packed],
    vals: &[Option<Val>],
    dest: &mut Dest,
    epilogue: Option<&fused::Pass>,
    threads: usize,
) -> KResult<()> {
    let Op::Conv {
        stride,
        padding,
        dilation,
        groups,
        has_bias,
    } = &node.op
    else {
        return Err(CpuError::Internal(format!(
            "{} is not a conv",
            node.op.name()
        )));
    };
    let x = value(vals, node.inputs[0])?;
    let w = value(vals, node.inputs[1])?;
    let bias = match has_bias {
        true => Some(value(vals, node.inputs[2])?),
        false => None,
    };
    let p = conv::Params {
        stride,
        padding,
        dilation,
        groups: *groups,
    };
    conv::conv_into(x, w, bias, &p, packed, dest, epilogue, threads)
}

/// Dot node `id` written into `dest`, through its pre-packed weight when it has one.
fn dot_into(
    prog: &Program,
    id: usize,
    node: &Node,
    vals: &[Option<Val>],
    dest: &mut Dest,
    threads: usize,
) -> KResult<()> {
    let a = value(vals, node.inputs[0])?;
    match prog.packed[id].as_slice() {
        [packed] => dot::dot_into_packed(a, packed, dest, threads),
        _ => dot::dot_into(a, value(vals, node.inputs[1])?, dest, threads),
    }
}

/// A product written straight into its destination.
#[allow(clippy::too_many_arguments)]
fn run_dot(
    prog: &Program,
    plan: &Plan,
    id: usize,
    node: &Node,
    vals: &[Option<Val>],
    direct: Option<*mut u8>,
    arena: &mut Arena,
    threads: usize,
) -> KResult<Val> {
    let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct);
    dot_into(prog, id, node, vals, &mut dest, threads)?;
    dest.finish()
}

/// An integer product written into the arena (a fresh output of inference sizes would be
/// a fresh mapping, with its page faults, every call).
#[allow(clippy::too_many_arguments)]
fn run_integer_dot(
    prog: &Program,
    plan: &Plan,
    id: usize,
    node: &Node,
    vals: &[Option<Val>],
    direct: Option<*mut u8>,
    arena: &mut Arena,
    threads: usize,
) -> KResult<Val> {
    let mut dest = arena.dest(node.ty.dtype, &plan.shapes[id], direct);
    let (a, b) = (value(vals, node.inputs[0])?, value(vals, node.inputs[1])?);
    let prepared = prog.packed_integer[id].as_ref();
    integer_dot::integer_dot_into(a, b, prepared, dest.slice()?, threads)?;
    dest.finish()
}

pub(crate) fn eval(
    prog: &Program,
    plan: &Plan,
    id: usize,
    node: &Node,
    vals: &[Option<Val>],
    threads: usize,
) -> KResult<Val> {
    let args: Vec<&Val> = node
        .inputs
        .iter()
        .map(|&i| {
            vals[i]
                .as_ref()
                .ok_or_else(|| CpuError::Internal(format!("value %{i} is gone")))
        })
        .collect::<KResult<_>>()?;
    let arg = |i: usize| {
        args.get(i)
            .copied()
            .ok_or_else(|| CpuError::Internal(format!("{} lacks operand {i}", node.op.name())))
    };
    let shape = plan.shapes[id].as_slice();
    let bound = || {
        prog.bound[id]
            .clone()
            .ok_or_else(|| CpuError::Internal("source was not bound".into()))
    };
    let dtype = node.ty.dtype;
    match &node.op {
        Op::Input { .. } => Err(CpuError::Internal(
            "inputs are bound by the executor".into(),
        )),
        Op::Weight { .. } | Op::Constant(_) => bound(),
        // A permuted weight was pre-packed at compile time.
        Op::Permute { .. } if prog.bound[id].is_some() => bound(),
        Op::Kernel { .. } if prog.bound[id].is_some() => bound(),
        Op::Kernel { name, base } => match (name.as_str(), base.as_ref()) {
            (KERNEL_ROWWISE, Op::Dot) => dot::dot_rowwise(arg(0)?, arg(1)?, threads),
            (KERNEL_PACKED, Op::Permute { perm }) => mv::permute(arg(0)?, perm)?.contiguous(),
            _ => Err(CpuError::Unsupported(format!("no CPU kernel '{name}'"))),
        },
        Op::Full { .. } => mv::full(&bound()?, shape),
        Op::Iota { start, step } => {
            mv::iota(dtype, *start, *step, shape.first().copied().unwrap_or(1))
        }
        Op::Unary(u) => ew::unary(*u, arg(0)?),
        Op::Binary(b) => ew::binary(*b, arg(0)?, arg(1)?),
        Op::Where => ew::where_(arg(0)?, arg(1)?, arg(2)?),
        Op::Cast { to } => ew::cast(arg(0)?, *to),
        Op::Reduce { op, axes, .. } => reduce::reduce(*op, axes, arg(0)?, shape),
        Op::Dot => match prog.packed[id].as_slice() {
            // A half-precision weight packed widened at compile time.
            [packed] if node.ty.dtype != DType::F32 => {
                dot::dot_half_packed(arg(0)?, packed, threads)
            }
            _ => dot::dot(arg(0)?, arg(1)?, threads),
        },
        Op::IntegerDot => Err(CpuError::Internal(
            "integer products are written into a destination (`run_integer_dot`)".into(),
        )),
        Op::Reshape { .. } => mv::reshape(arg(0)?, shape),
        Op::Permute { perm } => mv::permute(arg(0)?, perm),
        Op::Expand { .. } => mv::expand(arg(0)?, shape),
        Op::Slice { axis, step, .. } => {
            let (start, end) = plan.slices[id];
            mv::slice(arg(0)?, *axis, start, end, *step)
        }
        Op::Flip { axes } => mv::flip(arg(0)?, axes),
        Op::Pad { pads, value } => mv::pad(arg(0)?, pads, *value, shape),
        Op::Concat { axis } => mv::concat(&args, *axis, shape),
        Op::CacheAppend { .. } => Err(CpuError::Internal(
            "cache_append is written into a destination".into(),
        )),
        Op::Gather { axis } => index::gather(arg(0)?, arg(1)?, *axis),
        Op::IndexSelect { axis } => index::index_select(arg(0)?, arg(1)?, *axis, shape),
        Op::Scatter { axis, reduce } => index::scatter(arg(0)?, arg(1)?, arg(2)?, *axis, *reduce),
        Op::Scan { axis, op } => reduce::scan(arg(0)?, *axis, *op),
        Op::Argsort { axis, descending } => reduce::argsort(arg(0)?, *axis, *descending),
        Op::GroupedDot => dot::grouped_dot(arg(0)?, arg(1)?, arg(2)?, threads),
        Op::BlockQuantDot { bits, block } => crate::kernels::block_quant_dot::block_quant_dot(
            arg(0)?,
            arg(1)?,
            arg(2)?,
            arg(3)?,
            (*bits, *block),
            threads,
        ),
        Op::Softmax { axis, log } => norm::softmax(arg(0)?, *axis, *log),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => Err(CpuError::Internal(
            "norms are written into a destination (`rows_into`)".into(),
        )),
        Op::Attention {
            scale,
            causal,
            has_mask,
        } => {
            let mask = if *has_mask { Some(arg(3)?) } else { None };
            let p = attention::Params {
                scale: *scale,
                causal: *causal,
            };
            attention::attention(arg(0)?, arg(1)?, arg(2)?, mask, &p, threads)
        }
        Op::Conv {
            stride,
            padding,
            dilation,
            groups,
            has_bias,
        } => {
            let bias = if *has_bias { Some(arg(2)?) } else { None };
            let p = conv::Params {
                stride,
                padding,
                dilation,
                groups: *groups,
            };
            conv::conv(arg(0)?, arg(1)?, bias, &p, shape, threads)
        }
        Op::Pool { .. } => pool::pool(arg(0)?, &pool_params(&node.op)?, shape),
    }
}
