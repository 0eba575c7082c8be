//! Translation tests on models built in Rust; numerics against ONNX Runtime live in
//! `tests/onnx/` (pytest).

use prost::Message;

use super::proto::*;
use super::{load, Source};
use crate::dim::Dim;
use crate::error::Error;
use crate::ir::Op;

fn tensor_type(elem: i32, dims: &[Result<i64, &str>]) -> Option<TypeProto> {
    Some(TypeProto {
        tensor_type: Some(TypeProtoTensor {
            elem_type: Some(elem),
            shape: Some(TensorShapeProto {
                dim: dims
                    .iter()
                    .map(|d| match d {
                        Ok(v) => Dimension {
                            dim_value: Some(*v),
                            dim_param: None,
                        },
                        Err(p) => Dimension {
                            dim_value: None,
                            dim_param: Some(p.to_string()),
                        },
                    })
                    .collect(),
            }),
        }),
    })
}

fn value(name: &str, elem: i32, dims: &[Result<i64, &str>]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: tensor_type(elem, dims),
    }
}

fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        name: Some(format!("{op}_node")),
        op_type: Some(op.into()),
        domain: None,
        attribute: vec![],
        overload: None,
    }
}

fn model(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    opset: i64,
) -> Vec<u8> {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        producer_name: None,
        graph: Some(GraphProto {
            node: nodes,
            name: Some("g".into()),
            initializer: vec![],
            sparse_initializer: vec![],
            input: inputs,
            output: outputs,
            value_info: vec![],
        }),
        functions: vec![],
    }
    .encode_to_vec()
}

/// x [b, 6] → Shape → Gather(0) → Concat([b], [2, 3]) → Reshape: a symbolic reshape, with
/// no run-time shape tensor left in the graph.
#[test]
fn shape_arithmetic_folds_to_symbolic_dims() {
    let idx = TensorProto {
        dims: vec![1],
        data_type: Some(7),
        int64_data: vec![0],
        name: Some("idx".into()),
        ..Default::default()
    };
    let tail = TensorProto {
        dims: vec![2],
        data_type: Some(7),
        int64_data: vec![2, 3],
        name: Some("tail".into()),
        ..Default::default()
    };
    let mut bytes = ModelProto::decode(
        model(
            vec![
                node("Shape", &["x"], &["s"]),
                node("Gather", &["s", "idx"], &["b"]),
                node("Concat", &["b", "tail"], &["shape"]),
                node("Reshape", &["x", "shape"], &["y"]),
            ],
            vec![value("x", 1, &[Err("batch"), Ok(6)])],
            vec![value("y", 1, &[Err("batch"), Ok(2), Ok(3)])],
            17,
        )
        .as_slice(),
    )
    .unwrap();
    let g = bytes.graph.as_mut().unwrap();
    g.initializer = vec![idx, tail];
    g.node[2].attribute.push(AttributeProto {
        name: Some("axis".into()),
        i: Some(0),
        r#type: Some(2),
        ..Default::default()
    });
    let p = load(Source::Bytes(&bytes.encode_to_vec())).unwrap();
    let out = p.graph.outputs[0];
    assert_eq!(
        p.graph.ty(out).shape,
        vec![Dim::sym("batch"), Dim::Const(2), Dim::Const(3)]
    );
    // The shape initializers only fed the folding: no constants, gathers or concats remain.
    assert!(p.graph.nodes.iter().all(|n| !matches!(
        n.op,
        Op::Concat { .. } | Op::IndexSelect { .. } | Op::Constant(_)
    )));
    assert_eq!(p.graph.nodes.len(), 2, "input and reshape");
}

fn load_err(bytes: &[u8]) -> Error {
    match load(Source::Bytes(bytes)) {
        Ok(_) => panic!("loaded"),
        Err(e) => e,
    }
}

#[test]
fn rejects_garbage_opsets_and_unknown_ops() {
    let err = load_err(b"\xff\xff\xff not onnx");
    assert!(matches!(err, Error::Compile(m) if m.contains("not a valid ONNX model")));

    let x = || vec![value("x", 1, &[Ok(2)])];
    let old = model(vec![node("Relu", &["x"], &["y"])], x(), x(), 9);
    let err = load_err(&old);
    assert!(err.to_string().contains("opset 9"), "{err}");

    let unknown = model(vec![node("FancyOp", &["x"], &["y"])], x(), x(), 17);
    match load_err(&unknown) {
        Error::UnsupportedOp { op, node, .. } => {
            assert_eq!(op, "FancyOp");
            assert_eq!(node, "FancyOp_node");
        }
        e => panic!("{e}"),
    }
}
