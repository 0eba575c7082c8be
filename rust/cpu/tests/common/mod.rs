//! Test harness: small graphs, seeded random inputs, and a comparison of the CPU backend's
//! outputs with the reference interpreter's.
#![allow(dead_code)]

use ember_core::backend::{Backend, Weights};
use ember_core::dim::Dim;
use ember_core::dtype::DType;
use ember_core::interp::{self, Value};
use ember_core::ir::{Graph, Op, TensorType, ValueId};
use ember_core::tensor::{contiguous_strides, TensorOut, TensorView};
use ember_cpu::CpuBackend;

/// splitmix64: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
}

pub fn ty(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.iter().map(|&d| Dim::from(d)).collect())
}

pub fn input(g: &mut Graph, index: usize, dtype: DType, shape: &[usize]) -> ValueId {
    g.add_source(Op::Input { index }, ty(dtype, shape), &format!("in{index}"))
        .unwrap()
}

/// Random values: floats uniform in [lo, hi], integers in [lo, hi] (clamped to the dtype),
/// bools fair coins.
pub fn random(rng: &mut Rng, dtype: DType, shape: &[usize], lo: f64, hi: f64) -> Value {
    let n: usize = shape.iter().product();
    if dtype.is_float() {
        let v = (0..n).map(|_| rng.range(lo, hi)).collect();
        Value::from_f64(dtype, shape.to_vec(), v)
    } else {
        let (lo, hi) = match dtype {
            DType::Bool => (0, 1),
            DType::U8 => ((lo as i64).max(0), (hi as i64).min(255)),
            DType::I8 => ((lo as i64).max(-128), (hi as i64).min(127)),
            _ => (lo as i64, hi as i64),
        };
        let v = (0..n).map(|_| rng.int(lo, hi)).collect();
        Value::from_i64(dtype, shape.to_vec(), v)
    }
}

/// Bytes in 8-byte-aligned storage.
pub fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8).max(1)];
    // SAFETY: v holds at least bytes.len() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len())
    };
    v
}

/// An input given as storage + strides (elements), to test non-contiguous views.
pub struct Strided {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub storage: Vec<u64>,
    /// Byte offset of element 0 inside the storage.
    pub byte_offset: usize,
}

impl Strided {
    pub fn contiguous(v: &Value) -> Strided {
        Strided {
            dtype: v.dtype,
            shape: v.shape.clone(),
            strides: contiguous_strides(&v.shape),
            storage: aligned(&v.to_bytes()),
            byte_offset: 0,
        }
    }

    /// The same logical tensor stored transposed (last two dims swapped in memory).
    pub fn transposed(v: &Value) -> Strided {
        let r = v.shape.len();
        assert!(r >= 2);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let stored_shape: Vec<usize> = perm.iter().map(|&p| v.shape[p]).collect();
        let src = v.to_bytes();
        let size = v.dtype.size();
        let cs = contiguous_strides(&v.shape);
        let ss = contiguous_strides(&stored_shape);
        let mut out = vec![0u8; src.len()];
        // element at logical index i lives at stored position with dims swapped
        let n = v.numel();
        for lin in 0..n {
            let mut rem = lin;
            let mut pos = 0;
            for d in 0..r {
                let idx = rem / cs[d];
                rem %= cs[d];
                pos += idx * ss[perm.iter().position(|&p| p == d).unwrap()];
            }
            out[pos * size..(pos + 1) * size].copy_from_slice(&src[lin * size..(lin + 1) * size]);
        }
        let mut strides = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            strides[p] = ss[i];
        }
        Strided {
            dtype: v.dtype,
            shape: v.shape.clone(),
            strides,
            storage: aligned(&out),
            byte_offset: 0,
        }
    }

    pub fn view(&self) -> TensorView {
        TensorView {
            ptr: (self.storage.as_ptr() as *const u8).wrapping_add(self.byte_offset),
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
        }
    }
}

pub fn run_cpu_strided(
    backend: &CpuBackend,
    g: &Graph,
    w: &Weights,
    inputs: &[Strided],
) -> ember_core::Result<Vec<Value>> {
    let exe = backend.compile(g, w)?;
    let shapes: Vec<Vec<usize>> = inputs.iter().map(|s| s.shape.clone()).collect();
    let out_shapes = exe.output_shapes(&shapes)?;
    let mut bufs: Vec<Vec<u64>> = Vec::new();
    let mut outs = Vec::new();
    for (shape, &o) in out_shapes.iter().zip(&g.outputs) {
        let dtype = g.ty(o).dtype;
        let bytes = shape.iter().product::<usize>() * dtype.size();
        bufs.push(vec![0u64; bytes.div_ceil(8).max(1)]);
        outs.push((dtype, shape.clone(), bytes));
    }
    let out_views: Vec<TensorOut> = outs
        .iter()
        .zip(bufs.iter_mut())
        .map(|((dtype, shape, _), b)| TensorOut {
            ptr: b.as_mut_ptr() as *mut u8,
            dtype: *dtype,
            shape: shape.clone(),
        })
        .collect();
    let views: Vec<TensorView> = inputs.iter().map(|s| s.view()).collect();
    // SAFETY: views and outputs point at live buffers of the right sizes.
    unsafe { exe.run(&views, &out_views)? };
    outs.iter()
        .zip(&bufs)
        .map(|((dtype, shape, bytes), b)| {
            // SAFETY: b holds at least `bytes` bytes.
            let raw = unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, *bytes) };
            Value::from_bytes(*dtype, shape.clone(), raw)
        })
        .collect()
}

pub fn run_cpu(g: &Graph, w: &Weights, inputs: &[Value]) -> ember_core::Result<Vec<Value>> {
    let strided: Vec<Strided> = inputs.iter().map(Strided::contiguous).collect();
    run_cpu_strided(&CpuBackend::new(2), g, w, &strided)
}

/// Default tolerance (relative to 1 + |expected|) for a dtype.
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::F32 => 2e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    }
}

pub fn assert_close(got: &Value, want: &Value, tol: f64, what: &str) {
    assert_eq!(got.dtype, want.dtype, "{what}: dtype");
    assert_eq!(got.shape, want.shape, "{what}: shape");
    if got.dtype.is_float() {
        let (a, b) = (got.to_f64_vec(), want.to_f64_vec());
        for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
            let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= tol * (1.0 + y.abs());
            assert!(ok, "{what}: element {i}: got {x}, want {y}");
        }
    } else {
        assert_eq!(got.to_i64_vec(), want.to_i64_vec(), "{what}");
    }
}

/// Runs the graph on the CPU backend and the interpreter and compares every output.
pub fn check_with(g: &Graph, w: &Weights, inputs: &[Value], tol: f64, what: &str) {
    let want = interp::run(g, w, inputs).unwrap_or_else(|e| panic!("{what}: interpreter: {e}"));
    let got = run_cpu(g, w, inputs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    assert_eq!(got.len(), want.len());
    for (k, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_close(a, b, tol, &format!("{what} output {k}"));
    }
}

pub fn check(g: &Graph, inputs: &[Value], what: &str) {
    let dtype = g.ty(g.outputs[0]).dtype;
    check_with(g, &Weights::new(), inputs, tol(dtype), what);
}

/// One op applied to fresh inputs of the given types.
pub fn op_graph(op: Op, ins: &[(DType, &[usize])]) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<ValueId> = ins
        .iter()
        .enumerate()
        .map(|(i, (d, s))| input(&mut g, i, *d, s))
        .collect();
    let out = g.add(op, &ids, "op").unwrap();
    g.outputs.push(out);
    g
}
