//! `com.microsoft.MatMulNBits`: a product with block-quantized 2-, 4- or 8-bit weights, as
//! ONNX Runtime's `MatMulNBitsQuantizer` and its LLM builders (int4 models) write it.
//!
//! The packed weights, scales and zero points are initializers. They stay packed: the node
//! becomes one `BlockQuantDot` over A's rows, whose kernels unpack each block as they use
//! it, so an int4 model holds and reads a half byte per weight (plus a scale and a zero
//! point per block). The numbers are the dequantized product's, what ONNX Runtime computes
//! at `accuracy_level` 0 or 1 (at level 4 it rounds the activations to int8 first, about
//! 0.5 % off). Only weights whose columns `g_idx` regroups are dequantized here, once, to
//! an ordinary float product.

use super::Handler;
use crate::dim::{numel, Dim};
use crate::dtype::DType;
use crate::error::Result;
use crate::frontend::onnx::node::Node;
use crate::frontend::onnx::tensor::{floats, Decoded};
use crate::frontend::onnx::translate::{Ctx, Val};
use crate::ir::{BinaryOp, Op};

pub fn handler(op: &str) -> Option<Handler> {
    match op {
        "MatMulNBits" => Some(matmul_nbits),
        _ => None,
    }
}

/// A quantized element `i` of a row of `bits`-wide values packed low bits first.
fn unpack(bytes: &[u8], i: usize, bits: usize) -> u8 {
    let per_byte = 8 / bits;
    let byte = bytes[i / per_byte];
    (byte >> ((i % per_byte) * bits)) & ((1u16 << bits) - 1) as u8
}

/// How the weight `[N, K]` was quantized, read from the node.
struct Layout {
    k: usize,
    n: usize,
    bits: usize,
    block: usize,
    blocks: usize,
}

fn layout(node: &Node) -> Result<Layout> {
    let (k, n) = (node.int("K", 0)?, node.int("N", 0)?);
    let bits = node.int("bits", 4)?;
    let block = node.int("block_size", 0)?;
    if k <= 0 || n <= 0 {
        return Err(node.err("the K and N attributes must be positive"));
    }
    if !matches!(bits, 2 | 4 | 8) {
        return Err(node.unsupported(format!("{bits}-bit weights (2, 4 and 8 bits are read)")));
    }
    if block < 16 || block & (block - 1) != 0 {
        return Err(node.err(format!("block_size {block} (a power of two, at least 16)")));
    }
    let (k, n, block) = (k as usize, n as usize, block as usize);
    Ok(Layout {
        k,
        n,
        bits: bits as usize,
        block,
        blocks: k.div_ceil(block),
    })
}

/// Scales and zero points per (row, block), and the packed bytes `[N, blocks · blob]`,
/// checked against the layout.
struct Quantized {
    packed: Vec<u8>,
    scales: Vec<f64>,
    zero_points: Vec<f64>,
}

fn quantized(
    node: &Node,
    l: &Layout,
    b: Option<&Decoded>,
    scales: Option<&Decoded>,
    zeros: Option<&Decoded>,
) -> Result<Quantized> {
    let b = b.ok_or_else(|| {
        node.unsupported("packed weights computed at run time (B must be an initializer)")
    })?;
    let scales = scales.ok_or_else(|| {
        node.unsupported("scales computed at run time (they must be an initializer)")
    })?;
    let blob = l.block * l.bits / 8;
    if b.dtype != DType::U8 || b.bytes.len() != l.n * l.blocks * blob {
        return Err(node.err(format!(
            "B must hold uint8 [{}, {}, {blob}] for K={}, N={}, {} bits, block {}",
            l.n, l.blocks, l.k, l.n, l.bits, l.block
        )));
    }
    let scales = floats(scales);
    if scales.len() != l.n * l.blocks {
        return Err(node.err(format!(
            "scales must have N·blocks = {} elements",
            l.n * l.blocks
        )));
    }
    // Zero points per (row, block): packed like the weights, or float; 2^(bits−1) by default.
    let middle = (1u32 << (l.bits - 1)) as f64;
    let zero_points: Vec<f64> = match zeros {
        None => vec![middle; l.n * l.blocks],
        Some(z) if z.dtype == DType::U8 => {
            let row = (l.blocks * l.bits).div_ceil(8);
            if z.bytes.len() != l.n * row {
                return Err(node.err(format!("packed zero_points must be [{}, {row}] uint8", l.n)));
            }
            (0..l.n * l.blocks)
                .map(|i| unpack(&z.bytes[(i / l.blocks) * row..], i % l.blocks, l.bits) as f64)
                .collect()
        }
        Some(z) => {
            let z = floats(z);
            if z.len() != l.n * l.blocks {
                return Err(node.err(format!(
                    "zero_points must have N·blocks = {} elements",
                    l.n * l.blocks
                )));
            }
            z
        }
    };
    Ok(Quantized {
        packed: b.bytes.clone(),
        scales,
        zero_points,
    })
}

/// The float weight `[K, N]` (transposed: the product's right operand) in `dtype`, for
/// weights whose columns are grouped by `g_idx` (the packed product reads blocks of
/// consecutive columns only).
fn dequantize(
    node: &Node,
    l: &Layout,
    q: &Quantized,
    g_idx: &Decoded,
    dtype: DType,
) -> Result<Decoded> {
    let g = crate::frontend::onnx::tensor::ints(g_idx).unwrap_or_default();
    if g.len() != l.k || g.iter().any(|&x| x < 0 || x as usize >= l.blocks) {
        return Err(node.err(format!(
            "g_idx must hold K = {} block numbers below {}",
            l.k, l.blocks
        )));
    }
    let blob = l.block * l.bits / 8;
    let mut w = vec![0f32; l.k * l.n];
    for row in 0..l.n {
        let packed = &q.packed[row * l.blocks * blob..(row + 1) * l.blocks * blob];
        for (col, &group) in g.iter().enumerate() {
            let v = unpack(packed, col, l.bits) as f64;
            let at = row * l.blocks + group as usize;
            w[col * l.n + row] = ((v - q.zero_points[at]) * q.scales[at]) as f32;
        }
    }
    let bytes = match dtype {
        DType::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => w
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::BF16 => w
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => return Err(node.err(format!("input A of {other} (a float type is read)"))),
    };
    Ok(Decoded {
        dtype,
        shape: vec![l.k, l.n],
        bytes,
    })
}

/// `[N, blocks]` f32 values (scales or zero points) as a weight.
fn per_block(l: &Layout, values: &[f64]) -> Decoded {
    Decoded {
        dtype: DType::F32,
        shape: vec![l.n, l.blocks],
        bytes: values
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect(),
    }
}

/// `A · dequantize(B)ᵀ (+ bias)`.
fn matmul_nbits(ctx: &mut Ctx, n: &Node) -> Result<Vec<Val>> {
    let a = ctx.input(n, 0)?;
    let dtype = ctx.b.dtype(a);
    if !dtype.is_float() {
        return Err(n.err(format!("input A must be float, got {dtype}")));
    }
    let l = layout(n)?;
    let rank = ctx.b.rank(a);
    if rank == 0 || ctx.b.shape(a)[rank - 1] != Dim::Const(l.k as i64) {
        return Err(n.err(format!("A's last dim must be K = {}", l.k)));
    }
    let part = |k: usize| ctx.initializer_of(n, k);
    let b_name = part(1).map(|(name, _)| name.to_string()).ok_or_else(|| {
        n.unsupported("packed weights computed at run time (B must be an initializer)")
    })?;
    for (k, what) in [(2, "scales"), (3, "zero_points"), (4, "g_idx")] {
        if n.input(k).is_some() && part(k).is_none() {
            return Err(n.unsupported(format!(
                "{what} computed at run time (an initializer is read)"
            )));
        }
    }
    let data = |k: usize| part(k).map(|(_, d)| d);
    // The packed bytes are copied once, here (the weight is built from them below).
    let q = quantized(n, &l, data(1), data(2), data(3))?;
    let g_idx = data(4).cloned();
    // Weights derived from B are named after it, so nodes sharing B share them.
    let mut y = match &g_idx {
        // Columns regrouped: dequantized once, here, to an ordinary product.
        Some(g) => {
            let w = ctx.weight(&format!("{b_name}#dequantized.{dtype}"), || {
                dequantize(n, &l, &q, g, dtype)
            })?;
            ctx.b.matmul(a, w)?
        }
        // The weight stays packed: one `BlockQuantDot` over A's rows.
        None => {
            let blob = l.block * l.bits / 8;
            let Quantized {
                packed,
                scales,
                zero_points,
            } = q;
            let packed = ctx.weight(&format!("{b_name}#packed"), || {
                Ok(Decoded {
                    dtype: DType::U8,
                    shape: vec![l.n, l.blocks * blob],
                    bytes: packed,
                })
            })?;
            let scales = ctx.weight(&format!("{b_name}#scales"), || Ok(per_block(&l, &scales)))?;
            let zeros = ctx.weight(&format!("{b_name}#zero_points"), || {
                Ok(per_block(&l, &zero_points))
            })?;
            let shape = ctx.b.shape(a);
            let lead = shape[..rank - 1].to_vec();
            let rows = ctx
                .b
                .reshape(a, vec![numel(&lead), Dim::Const(l.k as i64)])?;
            let op = Op::BlockQuantDot {
                bits: l.bits as u8,
                block: l.block,
            };
            let y = ctx.b.op(op, &[rows, packed, scales, zeros])?;
            let mut out = lead;
            out.push(Dim::Const(l.n as i64));
            ctx.b.reshape(y, out)?
        }
    };
    if let Some(bias) = ctx.opt_input(n, 5)? {
        if ctx.b.shape(bias) != [Dim::Const(l.n as i64)] || ctx.b.dtype(bias) != dtype {
            return Err(n.err(format!("bias must be a [{}] {dtype} vector", l.n)));
        }
        y = super::bin(ctx, BinaryOp::Add, y, bias)?;
    }
    Ok(vec![Val::of(y)])
}
