//! Direct convolution and pooling: one thread per output element.

use ember_core::dim::numel;
use ember_core::dtype::Kind;
use ember_core::ir::PoolKind;

use super::super::types::{accumulate_type, store};
use super::super::{CodegenError, Launch, StepKind};
use super::{err, inf, Body, Generator, GRID_STRIDE};

impl Generator<'_> {
    /// Direct convolution: one thread per output element.
    pub(super) fn conv(
        &mut self,
        id: usize,
        stride: &[i64],
        padding: &[(i64, i64)],
        dilation: &[i64],
        groups: i64,
        has_bias: bool,
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("convolution of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let (x, w) = (n.inputs[0], n.inputs[1]);
        let xs = g.nodes[x].ty.shape.clone();
        let ws = g.nodes[w].ty.shape.clone();
        let out = n.ty.shape.clone();
        let sp = stride.len();
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.line(format!("const i64 og = {} / {groups}LL;", e.dim(&ws[0])));
        e.line(format!("const i64 cg = {};", e.dim(&ws[1])));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        let init = if has_bias {
            let b = e.value(n.inputs[2], &oidx[1..2])?;
            format!("({acc}){b}")
        } else {
            "0".into()
        };
        e.line(format!("{acc} a = {init};"));
        e.line(format!("const i64 grp = {} / og;", oidx[1]));
        e.open("for (i64 c = 0; c < cg; ++c)");
        let mut xidx = vec![oidx[0].clone(), "(grp * cg + c)".to_string()];
        let mut widx = vec![oidx[1].clone(), "c".to_string()];
        for d in 0..sp {
            let (kv, pv) = (format!("k{d}"), format!("p{d}"));
            e.open(format!(
                "for (i64 {kv} = 0; {kv} < {}; ++{kv})",
                e.dim(&ws[2 + d])
            ));
            e.line(format!(
                "const i64 {pv} = {} * {}LL - {}LL + {kv} * {}LL;",
                oidx[2 + d],
                stride[d],
                padding[d].0,
                dilation[d]
            ));
            e.line(format!(
                "if ({pv} < 0 || {pv} >= {}) continue;",
                e.dim(&xs[2 + d])
            ));
            xidx.push(pv);
            widx.push(kv);
        }
        let xv = e.value(x, &xidx)?;
        let wv = e.value(w, &widx)?;
        e.line(format!("a += ({acc}){xv} * ({acc}){wv};"));
        for _ in 0..sp {
            e.close();
        }
        e.close();
        e.line(format!("out[i] = {};", store(dtype, "a")));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&out))))
    }

    pub(super) fn pool(
        &mut self,
        id: usize,
        kind: PoolKind,
        kernel: &[i64],
        stride: &[i64],
        padding: &[i64],
        dilation: &[i64],
    ) -> Result<StepKind, CodegenError> {
        let g = self.g;
        let n = &g.nodes[id];
        let dtype = n.ty.dtype;
        if dtype.kind() != Kind::Float {
            return Err(err(g, id, format!("pooling of {dtype}")));
        }
        let acc = accumulate_type(dtype);
        let x = n.inputs[0];
        let xs = g.nodes[x].ty.shape.clone();
        let out = n.ty.shape.clone();
        let sp = kernel.len();
        let lead = out.len() - sp;
        let mut e = self.emitter(None);
        e.line(format!("const i64 n = {};", e.dims.product(&out)));
        e.open(GRID_STRIDE);
        let oidx = e.unravel("i", &out);
        e.line(format!(
            "{acc} mx = -{}; bool nan = false; {acc} sum = 0; i64 cnt = 0;",
            inf(acc)
        ));
        let mut xidx = oidx[..lead].to_vec();
        for d in 0..sp {
            let (kv, pv) = (format!("k{d}"), format!("p{d}"));
            e.open(format!(
                "for (i64 {kv} = 0; {kv} < {}LL; ++{kv})",
                kernel[d]
            ));
            e.line(format!(
                "const i64 {pv} = {} * {}LL - {}LL + {kv} * {}LL;",
                oidx[lead + d],
                stride[d],
                padding[d],
                dilation[d]
            ));
            e.line(format!(
                "if ({pv} < 0 || {pv} >= {}) continue;",
                e.dim(&xs[lead + d])
            ));
            xidx.push(pv);
        }
        let v = e.value(x, &xidx)?;
        e.line(format!("const {acc} t = ({acc}){v};"));
        e.line("nan |= t != t; mx = t > mx ? t : mx; sum += t; cnt += 1;");
        for _ in 0..sp {
            e.close();
        }
        let result = match kind {
            PoolKind::Max => format!(
                "nan ? ({acc})({}) : mx",
                if acc == "double" {
                    "EMBER_NAN64"
                } else {
                    "EMBER_NAN"
                }
            ),
            PoolKind::Avg {
                divisor: Some(d), ..
            } => format!("sum / ({acc}){d}"),
            PoolKind::Avg {
                count_include_pad: true,
                ..
            } => {
                let mut size = Vec::new();
                for d in 0..sp {
                    let start =
                        format!("({} * {}LL - {}LL)", oidx[lead + d], stride[d], padding[d]);
                    size.push(format!(
                        "(ember_dmin({start} + {}LL, {} + {}LL) - {start})",
                        kernel[d],
                        e.dim(&xs[lead + d]),
                        padding[d]
                    ));
                }
                format!("sum / ({acc})({})", size.join(" * "))
            }
            PoolKind::Avg { .. } => format!("sum / ({acc})cnt"),
        };
        e.line(format!("out[i] = {};", store(dtype, &result)));
        e.close();
        let body = Body::of(e, false);
        Ok(self.add(id, body, Launch::Elements(numel(&out))))
    }
}
