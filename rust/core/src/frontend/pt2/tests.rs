//! Frontend tests on hand-written serialized programs (the JSON `torch.export.save` writes),
//! run through the reference interpreter.

use serde_json::{json, Value as Json};

use super::translate::{translate, MUTATION_PREFIX};
use crate::backend::Weights;
use crate::dtype::DType;
use crate::error::Error;
use crate::interp::{run, Value};
use crate::tensor::HostTensor;

fn tensor_meta(dtype: i64, sizes: Json) -> Json {
    json!({"dtype": dtype, "sizes": sizes, "strides": [], "storage_offset": {"as_int": 0}})
}

fn t(name: &str) -> Json {
    json!({"as_tensor": {"name": name}})
}

/// A program `out = (x + w) * 2` with x: input [2, s0] (symbolic), w: weight [s0-sized] = [3].
fn program(target: &str, output_kind: &str) -> Json {
    json!({
        "graph_module": {
            "graph": {
                "inputs": [t("p_w"), t("x")],
                "outputs": [t("mul")],
                "nodes": [
                    {"target": "torch.ops.aten.add.Tensor", "name": "add",
                     "inputs": [{"name": "self", "arg": t("x"), "kind": 1},
                                {"name": "other", "arg": t("p_w"), "kind": 1}],
                     "outputs": [t("add")]},
                    {"target": target, "name": "mul",
                     "inputs": [{"name": "self", "arg": t("add"), "kind": 1},
                                {"name": "other", "arg": {"as_int": 2}, "kind": 1}],
                     "outputs": [t("mul")]}
                ],
                "tensor_values": {
                    "p_w": tensor_meta(7, json!([{"as_int": 3}])),
                    "x": tensor_meta(7, json!([{"as_expr": {"expr_str": "s0"}}, {"as_int": 3}])),
                    "add": tensor_meta(7, json!([{"as_expr": {"expr_str": "s0"}}, {"as_int": 3}])),
                    "mul": tensor_meta(7, json!([{"as_expr": {"expr_str": "s0"}}, {"as_int": 3}]))
                }
            },
            "signature": {
                "input_specs": [
                    {"parameter": {"arg": {"name": "p_w"}, "parameter_name": "w"}},
                    {"user_input": {"arg": t("x")}}
                ],
                "output_specs": [{output_kind: {"arg": t("mul")}}]
            }
        },
        "range_constraints": {"s0": {"min_val": 1, "max_val": 64}}
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn translates_broadcasting_add_and_scalar_mul_with_symbolic_dims() {
    let p = translate(
        &program("torch.ops.aten.mul.Tensor", "user_output"),
        Weights::new(),
    )
    .unwrap();
    assert_eq!(p.input_names, vec!["x"]);
    assert_eq!(p.weight_specs, vec![("w".to_string(), DType::F32, vec![3])]);
    assert!(p.graph.symbols.contains_key("s0"));
    let mut weights = Weights::new();
    weights.insert(
        "w".into(),
        HostTensor::owned(DType::F32, vec![3], f32_bytes(&[1.0, 2.0, 3.0])).unwrap(),
    );
    // The same program serves two batch sizes.
    for rows in [1usize, 4] {
        let xs: Vec<f32> = (0..rows * 3).map(|i| i as f32).collect();
        let x = Value::from_bytes(DType::F32, vec![rows, 3], &f32_bytes(&xs)).unwrap();
        let out = run(&p.graph, &weights, &[x]).unwrap();
        let want: Vec<f64> = xs
            .iter()
            .enumerate()
            .map(|(i, &v)| 2.0 * (v as f64 + [1.0, 2.0, 3.0][i % 3]))
            .collect();
        assert_eq!(out[0].to_f64_vec(), want);
    }
    // The range constraint is enforced at call time.
    let x = Value::from_bytes(DType::F32, vec![65, 3], &f32_bytes(&vec![0.0; 195])).unwrap();
    assert!(run(&p.graph, &weights, &[x]).is_err());
}

#[test]
fn unsupported_op_names_the_op_and_node() {
    match translate(
        &program("torch.ops.mylib.frobnicate.default", "user_output"),
        Weights::new(),
    ) {
        Err(Error::UnsupportedOp { op, node, .. }) => {
            assert_eq!(op, "mylib.frobnicate.default");
            assert_eq!(node, "mul");
        }
        other => panic!("expected UnsupportedOp, got {:?}", other.err()),
    }
}

#[test]
fn input_mutations_are_outputs_named_after_their_input() {
    let mut p = program("torch.ops.aten.mul.Tensor", "user_input_mutation");
    p["graph_module"]["signature"]["output_specs"][0]["user_input_mutation"]["user_input_name"] =
        json!("x");
    let prog = translate(&p, Weights::new()).unwrap();
    assert_eq!(prog.output_names, vec![format!("{MUTATION_PREFIX}x")]);
}

#[test]
fn mutation_without_its_target_is_unsupported() {
    let err = translate(
        &program("torch.ops.aten.mul.Tensor", "user_input_mutation"),
        Weights::new(),
    )
    .err()
    .expect("a mutation must name what it updates");
    assert!(matches!(err, Error::UnsupportedOp { .. }), "{err}");
}

#[test]
fn malformed_programs_are_errors() {
    assert!(translate(&json!({}), Weights::new()).is_err());
    assert!(translate(&json!({"graph_module": {"graph": 3}}), Weights::new()).is_err());
    let mut p = program("torch.ops.aten.mul.Tensor", "user_output");
    p["graph_module"]["graph"]["nodes"][1]["inputs"][0]["arg"] = t("nonexistent");
    assert!(translate(&p, Weights::new()).is_err());
}
