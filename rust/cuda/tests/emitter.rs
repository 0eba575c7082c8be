//! The element expressions the emitter writes, compiled and run on the emulator.

mod common;

use common::{check_against_reference, dims, input, values};
use ember_core::backend::Weights;
use ember_core::dtype::DType;
use ember_core::interp::Value;
use ember_core::ir::{Graph, Op, UnaryOp};

#[test]
fn a_kernel_with_more_than_64_index_temporaries_compiles() {
    // Each reshape re-linearizes the permuted index through fresh temporaries; the 64th
    // was once named `i64`, shadowing the index type, and the kernel did not compile.
    let mut g = Graph::new();
    let mut x = input(&mut g, 0, DType::F32, &[2, 3, 4], "x");
    for _ in 0..20 {
        // A permute then a reshape: the reshape unravels the permuted index afresh.
        x = g
            .add(
                Op::Permute {
                    perm: vec![2, 0, 1],
                },
                &[x],
                "p",
            )
            .unwrap();
        x = g
            .add(
                Op::Reshape {
                    shape: dims(&[2, 3, 4]),
                },
                &[x],
                "r",
            )
            .unwrap();
        x = g.add(Op::Unary(UnaryOp::Neg), &[x], "n").unwrap();
    }
    g.outputs = vec![x];
    let xs = [Value::from_f64(DType::F32, vec![2, 3, 4], values(24, 1))];
    check_against_reference("20 permuted reshapes", &g, &Weights::new(), &xs, false, 0.0);
}
