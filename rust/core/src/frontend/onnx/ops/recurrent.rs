//! Recurrent layers: `LSTM`, `GRU` and `RNN`, unrolled over a sequence length known at
//! compile time. The input projection of every step is one product (`X · Wᵀ + biases`), then
//! each step adds `H · Rᵀ` and applies the gates; forward, reverse and bidirectional, both
//! layouts, initial states, LSTM peepholes, `clip`, the standard activations and
//! `sequence_lens` (steps past a sequence's length are masked).

use super::{bin, scalar, Handler};
use crate::dim::Dim;
use crate::dtype::{DType, Scalar};
use crate::error::Result;
use crate::frontend::builder::Operand;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op, UnaryOp, ValueId};

pub fn handler(op: &str) -> Option<Handler> {
    Some(match op {
        "LSTM" | "GRU" | "RNN" => recurrent,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Lstm,
    Gru,
    Rnn,
}

impl Kind {
    /// Gate blocks in W, R and each half of B.
    fn gates(self) -> usize {
        match self {
            Kind::Lstm => 4,
            Kind::Gru => 3,
            Kind::Rnn => 1,
        }
    }

    /// The activation functions one direction takes, by default.
    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Kind::Lstm => &["Sigmoid", "Tanh", "Tanh"],
            Kind::Gru => &["Sigmoid", "Tanh"],
            Kind::Rnn => &["Tanh"],
        }
    }
}

#[derive(Clone, Copy)]
enum Act {
    Sigmoid,
    Tanh,
    Relu,
}

struct Layer {
    kind: Kind,
    hidden: i64,
    batch: Dim,
    dtype: DType,
    clip: Option<f64>,
    linear_before_reset: bool,
}

fn recurrent(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let kind = match n.op {
        "LSTM" => Kind::Lstm,
        "GRU" => Kind::Gru,
        _ => Kind::Rnn,
    };
    if kind == Kind::Lstm && n.int("input_forget", 0)? != 0 {
        return Err(n.unsupported("input_forget=1 (coupled input and forget gates)"));
    }
    let x = ctx.input(n, 0)?;
    let dtype = ctx.b.dtype(x);
    if !dtype.is_float() || ctx.b.rank(x) != 3 {
        return Err(n.err("X must be a 3-d float tensor"));
    }
    let layout = n.int("layout", 0)?;
    // Steps along axis 0: [T, B, I].
    let x = match layout {
        0 => x,
        1 => ctx.b.permute(x, vec![1, 0, 2])?,
        other => return Err(n.err(format!("unknown layout {other}"))),
    };
    let xs = ctx.b.shape(x);
    let steps = xs[0].as_const().ok_or_else(|| {
        n.unsupported(format!(
            "a sequence length {} unknown at compile time (the layer is unrolled)",
            xs[0]
        ))
    })?;
    let dirs: &[bool] = match n.string("direction", "forward")?.as_str() {
        "forward" => &[false],
        "reverse" => &[true],
        "bidirectional" => &[false, true],
        other => return Err(n.err(format!("unknown direction '{other}'"))),
    };
    let hidden = n.int("hidden_size", 0)?;
    let w = ctx.input(n, 1)?;
    let gates = kind.gates() as i64;
    let ws = ctx.b.shape(w);
    if hidden <= 0 || ws.len() != 3 || ws[1] != Dim::Const(gates * hidden) {
        return Err(n.err(format!(
            "W {} does not hold {gates} gates of hidden_size {hidden}",
            crate::dim::format_shape(&ws)
        )));
    }
    if ws[0] != Dim::Const(dirs.len() as i64) {
        return Err(n.err(format!(
            "W has {} directions, direction says {}",
            ws[0],
            dirs.len()
        )));
    }
    let acts = activations(n, kind, dirs.len())?;
    let layer = Layer {
        kind,
        hidden,
        batch: xs[1].clone(),
        dtype,
        clip: n
            .has_attr("clip")
            .then(|| n.float("clip", 0.0))
            .transpose()?
            .map(f64::from),
        linear_before_reset: n.int("linear_before_reset", 0)? != 0,
    };
    let r = ctx.input(n, 2)?;
    let bias = ctx.opt_input(n, 3)?;
    let lens = match ctx.opt_input(n, 4)? {
        Some(v) => Some(sequence_lens(ctx, n, v, &layer.batch)?),
        None => None,
    };
    // Initial states are [dirs, B, H] ([B, dirs, H] in layout 1).
    let mut states = [ctx.opt_input(n, 5)?, ctx.opt_input(n, 6)?];
    for s in states.iter_mut().filter(|_| layout == 1) {
        if let Some(v) = *s {
            if ctx.b.rank(v) != 3 {
                return Err(n.err("initial states must be 3-d"));
            }
            *s = Some(ctx.b.permute(v, vec![1, 0, 2])?);
        }
    }
    let [h0, c0] = states;
    let peep = ctx.opt_input(n, 7)?;
    let mut ys = Vec::new();
    let mut hs = Vec::new();
    let mut cs = Vec::new();
    for (d, &reverse) in dirs.iter().enumerate() {
        let pick = |ctx: &mut Ctx, v: Option<ValueId>| -> Result<Option<ValueId>> {
            v.map(|v| direction(ctx, n, v, d)).transpose()
        };
        let (wd, rd) = (direction(ctx, n, w, d)?, direction(ctx, n, r, d)?);
        let (bd, hd, cd, pd) = (
            pick(ctx, bias)?,
            pick(ctx, h0)?,
            pick(ctx, c0)?,
            pick(ctx, peep)?,
        );
        let acts = &acts[d * kind.default_activations().len()..];
        let (y, h, c) = run_direction(
            ctx,
            n,
            &layer,
            x,
            steps,
            reverse,
            [wd, rd],
            bd,
            hd,
            cd,
            pd,
            lens,
            acts,
        )?;
        ys.push(y);
        hs.push(h);
        cs.push(c);
    }
    // Y: [T, dirs, B, H]; Y_h, Y_c: [dirs, B, H] (layout 1: batch first).
    let y = ctx.b.op(Op::Concat { axis: 1 }, &ys)?;
    let yh = ctx.b.op(Op::Concat { axis: 0 }, &hs)?;
    let (y, yh) = match layout {
        0 => (y, yh),
        _ => (
            ctx.b.permute(y, vec![2, 0, 1, 3])?,
            ctx.b.permute(yh, vec![1, 0, 2])?,
        ),
    };
    let mut out = vec![Val::of(y), Val::of(yh)];
    if kind == Kind::Lstm {
        let yc = ctx.b.op(Op::Concat { axis: 0 }, &cs)?;
        let yc = match layout {
            0 => yc,
            _ => ctx.b.permute(yc, vec![1, 0, 2])?,
        };
        out.push(Val::of(yc));
    }
    Ok(out)
}

/// The `activations` attribute (per direction), defaults filled in; only parameterless
/// Sigmoid, Tanh and Relu are taken.
fn activations(n: &Node, kind: Kind, dirs: usize) -> Result<Vec<Act>> {
    let per = kind.default_activations();
    let names: Vec<String> = match n.strings("activations")? {
        Some(list) => list,
        None => (0..dirs)
            .flat_map(|_| per.iter().map(|s| s.to_string()))
            .collect(),
    };
    if names.len() != per.len() * dirs {
        return Err(n.err(format!(
            "{} activations for {dirs} direction(s) of {} each",
            names.len(),
            per.len()
        )));
    }
    if n.has_attr("activation_alpha") || n.has_attr("activation_beta") {
        return Err(n.unsupported("activation_alpha/activation_beta"));
    }
    names
        .iter()
        .map(|a| match a.as_str() {
            "Sigmoid" => Ok(Act::Sigmoid),
            "Tanh" => Ok(Act::Tanh),
            "Relu" => Ok(Act::Relu),
            other => Err(n.unsupported(format!("the activation {other}"))),
        })
        .collect()
}

/// Direction `d` of a `[dirs, …]` parameter, without its leading axis.
fn direction(ctx: &mut Ctx, n: &Node, v: ValueId, d: usize) -> Result<ValueId> {
    let s = ctx.b.shape(v);
    if s.is_empty() {
        return Err(n.err("a recurrent parameter must have a direction axis"));
    }
    let one = ctx
        .b
        .slice(v, 0, Dim::Const(d as i64), Dim::Const(d as i64 + 1), 1)?;
    ctx.b.reshape(one, s[1..].to_vec())
}

fn act(ctx: &mut Ctx, a: Act, x: ValueId) -> Result<ValueId> {
    ctx.b.unary(
        match a {
            Act::Sigmoid => UnaryOp::Sigmoid,
            Act::Tanh => UnaryOp::Tanh,
            Act::Relu => UnaryOp::Relu,
        },
        x,
    )
}

/// Gate block `k` (of width `hidden`) of `[B, G·H]` gate sums.
fn block(ctx: &mut Ctx, v: ValueId, k: i64, hidden: i64) -> Result<ValueId> {
    ctx.b.slice(
        v,
        1,
        Dim::Const(k * hidden),
        Dim::Const((k + 1) * hidden),
        1,
    )
}

/// `sequence_lens` ([batch] integers) as a [batch, 1] column that broadcasts over a state.
fn sequence_lens(ctx: &mut Ctx, n: &Node, v: ValueId, batch: &Dim) -> Result<ValueId> {
    let ty = ctx.b.ty(v).clone();
    let fits = ty.shape.len() == 1 && ty.shape[0].provably_equal(batch) != Some(false);
    if !ty.dtype.is_int() || !fits {
        return Err(n.err(format!(
            "sequence_lens must be integers of shape [{batch}], got {}{}",
            ty.dtype,
            crate::dim::format_shape(&ty.shape)
        )));
    }
    ctx.b.reshape(v, vec![batch.clone(), Dim::Const(1)])
}

/// One direction over every step: its outputs `[T, 1, B, H]`, last hidden and cell states
/// `[1, B, H]` (the cell state only for LSTM; the hidden state again otherwise).
#[allow(clippy::too_many_arguments)]
fn run_direction(
    ctx: &mut Ctx,
    n: &Node,
    l: &Layer,
    x: ValueId,
    steps: i64,
    reverse: bool,
    [w, r]: [ValueId; 2],
    bias: Option<ValueId>,
    h0: Option<ValueId>,
    c0: Option<ValueId>,
    peep: Option<ValueId>,
    lens: Option<ValueId>,
    acts: &[Act],
) -> Result<(ValueId, ValueId, ValueId)> {
    let (hd, g) = (l.hidden, l.kind.gates() as i64);
    let state = vec![l.batch.clone(), Dim::Const(hd)];
    let zeros = |ctx: &mut Ctx| {
        ctx.b
            .full(crate::dtype::Scalar::Float(0.0), l.dtype, state.clone())
    };
    let mut h = match h0 {
        Some(h) => h,
        None => zeros(ctx)?,
    };
    let mut c = match c0 {
        Some(c) => c,
        None => zeros(ctx)?,
    };
    for v in [h, c] {
        if ctx.b.shape(v) != state {
            return Err(n.err(format!(
                "an initial state of shape {} (want [batch, hidden])",
                crate::dim::format_shape(&ctx.b.shape(v))
            )));
        }
    }
    // Every step's input projection at once: [T, B, G·H], with W's bias (and R's, where
    // the gates add it outside the reset product).
    let wt = ctx.b.permute(w, vec![1, 0])?;
    let mut xw = ctx.b.matmul(x, wt)?;
    let (mut rb_h, rt) = (None, ctx.b.permute(r, vec![1, 0])?);
    if let Some(b) = bias {
        let wb = ctx.b.slice(b, 0, Dim::Const(0), Dim::Const(g * hd), 1)?;
        let rb = ctx
            .b
            .slice(b, 0, Dim::Const(g * hd), Dim::Const(2 * g * hd), 1)?;
        let mut both = bin(ctx, BinaryOp::Add, wb, rb)?;
        if l.kind == Kind::Gru {
            // The h gate's recurrent bias goes with R·H (inside r ⊙ (…) when linear before
            // reset); the input projection takes only W's.
            let zr = ctx.b.slice(both, 0, Dim::Const(0), Dim::Const(2 * hd), 1)?;
            let wbh = ctx
                .b
                .slice(wb, 0, Dim::Const(2 * hd), Dim::Const(3 * hd), 1)?;
            both = ctx.b.op(Op::Concat { axis: 0 }, &[zr, wbh])?;
            rb_h = Some(
                ctx.b
                    .slice(rb, 0, Dim::Const(2 * hd), Dim::Const(3 * hd), 1)?,
            );
        }
        xw = bin(ctx, BinaryOp::Add, xw, both)?;
    }
    let p = |ctx: &mut Ctx, k: i64| -> Result<Option<ValueId>> {
        peep.map(|p| {
            ctx.b
                .slice(p, 0, Dim::Const(k * hd), Dim::Const((k + 1) * hd), 1)
        })
        .transpose()
    };
    let (p_i, p_o, p_f) = (p(ctx, 0)?, p(ctx, 1)?, p(ctx, 2)?);
    let clip = |ctx: &mut Ctx, v: ValueId| -> Result<ValueId> {
        let Some(limit) = l.clip else { return Ok(v) };
        let hi = scalar(ctx, limit, l.dtype)?;
        let lo = scalar(ctx, -limit, l.dtype)?;
        let v = bin(ctx, BinaryOp::Min, v, hi)?;
        bin(ctx, BinaryOp::Max, v, lo)
    };
    let mut outs = vec![None; steps as usize];
    let order: Vec<i64> = match reverse {
        false => (0..steps).collect(),
        true => (0..steps).rev().collect(),
    };
    for t in order {
        let (h_before, c_before) = (h, c);
        let xt = ctx.b.slice(xw, 0, Dim::Const(t), Dim::Const(t + 1), 1)?;
        let xt = ctx
            .b
            .reshape(xt, vec![l.batch.clone(), Dim::Const(g * hd)])?;
        match l.kind {
            Kind::Lstm => {
                let hr = ctx.b.matmul(h, rt)?;
                let sums = bin(ctx, BinaryOp::Add, xt, hr)?;
                // ONNX's gate order: input, output, forget, cell.
                let gate = |ctx: &mut Ctx, k: i64, peep: Option<ValueId>, cell: ValueId| {
                    let mut s = block(ctx, sums, k, hd)?;
                    if let Some(p) = peep {
                        let pc = bin(ctx, BinaryOp::Mul, p, cell)?;
                        s = bin(ctx, BinaryOp::Add, s, pc)?;
                    }
                    clip(ctx, s)
                };
                let i = gate(ctx, 0, p_i, c)?;
                let i = act(ctx, acts[0], i)?;
                let f = gate(ctx, 2, p_f, c)?;
                let f = act(ctx, acts[0], f)?;
                let cand = gate(ctx, 3, None, c)?;
                let cand = act(ctx, acts[1], cand)?;
                let keep = bin(ctx, BinaryOp::Mul, f, c)?;
                let new = bin(ctx, BinaryOp::Mul, i, cand)?;
                c = bin(ctx, BinaryOp::Add, keep, new)?;
                let o = gate(ctx, 1, p_o, c)?;
                let o = act(ctx, acts[0], o)?;
                let hc = act(ctx, acts[2], c)?;
                h = bin(ctx, BinaryOp::Mul, o, hc)?;
            }
            Kind::Gru => {
                let rzr = ctx.b.slice(rt, 1, Dim::Const(0), Dim::Const(2 * hd), 1)?;
                let rh = ctx
                    .b
                    .slice(rt, 1, Dim::Const(2 * hd), Dim::Const(3 * hd), 1)?;
                let hzr = ctx.b.matmul(h, rzr)?;
                let xzr = ctx.b.slice(xt, 1, Dim::Const(0), Dim::Const(2 * hd), 1)?;
                let zr = bin(ctx, BinaryOp::Add, xzr, hzr)?;
                let z = block(ctx, zr, 0, hd)?;
                let z = clip(ctx, z)?;
                let z = act(ctx, acts[0], z)?;
                let rg = block(ctx, zr, 1, hd)?;
                let rg = clip(ctx, rg)?;
                let rg = act(ctx, acts[0], rg)?;
                let xh = block(ctx, xt, 2, hd)?;
                let recur = if l.linear_before_reset {
                    let mut hr = ctx.b.matmul(h, rh)?;
                    if let Some(b) = rb_h {
                        hr = bin(ctx, BinaryOp::Add, hr, b)?;
                    }
                    bin(ctx, BinaryOp::Mul, rg, hr)?
                } else {
                    let reset = bin(ctx, BinaryOp::Mul, rg, h)?;
                    let mut hr = ctx.b.matmul(reset, rh)?;
                    if let Some(b) = rb_h {
                        hr = bin(ctx, BinaryOp::Add, hr, b)?;
                    }
                    hr
                };
                let cand = bin(ctx, BinaryOp::Add, xh, recur)?;
                let cand = clip(ctx, cand)?;
                let cand = act(ctx, acts[1], cand)?;
                // (1 - z) ⊙ cand + z ⊙ h = cand + z ⊙ (h - cand)
                let diff = bin(ctx, BinaryOp::Sub, h, cand)?;
                let zd = bin(ctx, BinaryOp::Mul, z, diff)?;
                h = bin(ctx, BinaryOp::Add, cand, zd)?;
            }
            Kind::Rnn => {
                let hr = ctx.b.matmul(h, rt)?;
                let s = bin(ctx, BinaryOp::Add, xt, hr)?;
                let s = clip(ctx, s)?;
                h = act(ctx, acts[0], s)?;
            }
        }
        let mut y = h;
        if let Some(lens) = lens {
            // Past its length a sequence keeps its states and outputs zeros; a reverse
            // direction starts at each sequence's own last step.
            let valid = ctx.b.binary_in(
                BinaryOp::Gt,
                Operand::Tensor(lens),
                Operand::Scalar(Scalar::Int(t)),
                DType::I64,
            )?;
            h = ctx
                .b
                .where_(valid, Operand::Tensor(h), Operand::Tensor(h_before))?;
            if l.kind == Kind::Lstm {
                c = ctx
                    .b
                    .where_(valid, Operand::Tensor(c), Operand::Tensor(c_before))?;
            }
            y = ctx.b.where_(
                valid,
                Operand::Tensor(h),
                Operand::Scalar(Scalar::Float(0.0)),
            )?;
            y = ctx.b.cast(y, l.dtype)?;
        }
        let mut one_step = vec![Dim::Const(1), Dim::Const(1)];
        one_step.extend(state.iter().cloned());
        outs[t as usize] = Some(ctx.b.reshape(y, one_step)?);
    }
    let outs: Vec<ValueId> = outs.into_iter().flatten().collect();
    let y = ctx.b.op(Op::Concat { axis: 0 }, &outs)?;
    let mut last = vec![Dim::Const(1)];
    last.extend(state.iter().cloned());
    let hl = ctx.b.reshape(h, last.clone())?;
    let cl = match l.kind {
        Kind::Lstm => ctx.b.reshape(c, last)?,
        _ => hl,
    };
    Ok((y, hl, cl))
}
