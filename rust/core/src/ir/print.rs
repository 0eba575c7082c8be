//! Readable text form of a graph, for reports, debugging and test failure messages.

use std::fmt;

use super::{Graph, Op};
use crate::dim::format_shape;

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (id, n) in self.nodes.iter().enumerate() {
            let args: Vec<String> = n.inputs.iter().map(|i| format!("%{i}")).collect();
            let attrs = match &n.op {
                Op::Input { index } => format!("#{index}"),
                Op::Weight { name } => format!("'{name}'"),
                Op::Constant(c) => format!("{:?}", c.shape),
                Op::Full { value } => format!("{value:?}"),
                Op::Iota { start, step } => format!("start={start:?} step={step:?}"),
                Op::Cast { to } => to.to_string(),
                Op::Reduce { axes, keepdim, .. } => format!("axes={axes:?} keepdim={keepdim}"),
                Op::Reshape { shape } | Op::Expand { shape } => format_shape(shape),
                Op::Permute { perm } => format!("{perm:?}"),
                Op::Slice {
                    axis,
                    start,
                    end,
                    step,
                } => format!("axis={axis} {start}:{end}:{step}"),
                Op::Flip { axes } => format!("{axes:?}"),
                Op::CacheAppend { axis, len } => format!("axis={axis} len={len}"),
                Op::Pad { pads, value } => format!("{pads:?} value={value:?}"),
                Op::Concat { axis }
                | Op::Gather { axis }
                | Op::IndexSelect { axis }
                | Op::Scan { axis, .. } => format!("axis={axis}"),
                Op::Argsort { axis, descending } => {
                    format!("axis={axis} descending={descending}")
                }
                Op::Scatter { axis, reduce } => format!("axis={axis} reduce={reduce:?}"),
                Op::Softmax { axis, .. } => format!("axis={axis}"),
                Op::LayerNorm { axis, eps, .. } | Op::RmsNorm { axis, eps, .. } => {
                    format!("axis={axis} eps={eps}")
                }
                Op::Attention {
                    scale,
                    causal,
                    has_mask,
                } => format!("scale={scale} causal={causal} mask={has_mask}"),
                Op::Kernel { base, .. } => format!("{base:?}"),
                Op::Conv {
                    stride,
                    padding,
                    dilation,
                    groups,
                    has_bias,
                } => format!(
                    "stride={stride:?} padding={padding:?} dilation={dilation:?} \
                     groups={groups} bias={has_bias}"
                ),
                Op::Pool {
                    kind,
                    kernel,
                    stride,
                    padding,
                    dilation,
                    ceil_mode,
                } => format!(
                    "{kind:?} kernel={kernel:?} stride={stride:?} padding={padding:?} \
                     dilation={dilation:?} ceil_mode={ceil_mode}"
                ),
                _ => String::new(),
            };
            writeln!(
                f,
                "%{id} = {}({}) {} : {}{}",
                n.op.name(),
                args.join(", "),
                attrs,
                n.ty.dtype,
                format_shape(&n.ty.shape)
            )?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|o| format!("%{o}")).collect();
        writeln!(f, "return ({})", outs.join(", "))
    }
}
