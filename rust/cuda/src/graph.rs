//! Recordings on the GPU: a program's work as one CUDA graph — kernels as graph nodes of
//! their own, each cuBLASLt product a child graph captured from one call (cuBLASLt's kernels
//! cannot be named from outside), chained in order. The executor patches changed addresses
//! and product sizes into the instantiated graph node by node (`exec.rs`).

use std::sync::Arc;

use cudarc::driver::{result as drv, sys};
use ember_core::Result;

use crate::device::{driver_err, param_pointers, CudaDevice, Gpu};
use crate::exec::{GemmCall, Work};

/// A program's work as an instantiated CUDA graph: a chain of kernel nodes and cuBLASLt
/// child graphs.
pub struct GpuGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// The node of each work item, in order.
    nodes: Vec<sys::CUgraphNode>,
    /// Products captured (by the recording and by patches), by work item and call, the
    /// newest last: a loop whose outputs come from torch's allocator writes to a few
    /// addresses in turn (this call's logits where the last call's were freed), and a
    /// product patched back to a call it served before takes its capture again instead of
    /// capturing anew (a cuBLASLt call and a stream capture on the host, per call). At
    /// most `KEPT_CAPTURES` per item.
    captures: Vec<(usize, GemmCall, sys::CUgraph)>,
    gpu: Arc<Gpu>,
}

/// Captures kept per product node (see `GpuGraph::captures`).
const KEPT_CAPTURES: usize = 4;

// SAFETY: graph handles are driver objects usable from any thread with the context current;
// the executor uses a recording from one run at a time.
unsafe impl Send for GpuGraph {}

/// Calls `f` with the kernel node parameters of a launch (valid during the call; the
/// driver copies them).
fn with_kernel_node<R>(
    dev: &CudaDevice,
    (kernel, grid, block, args): (usize, u32, u32, &[u64]),
    f: impl FnOnce(&sys::CUDA_KERNEL_NODE_PARAMS) -> R,
) -> R {
    let mut values = param_pointers(args);
    f(&sys::CUDA_KERNEL_NODE_PARAMS {
        func: dev.functions[kernel],
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: values.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    })
}

impl GpuGraph {
    pub(crate) fn new(dev: &CudaDevice, work: &[Work]) -> Result<GpuGraph> {
        dev.gpu.make_current()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: creating an empty graph.
        unsafe { sys::cuGraphCreate(&mut graph, 0).result() }
            .map_err(|e| driver_err("graph creation", e))?;
        let mut me = GpuGraph {
            graph,
            exec: std::ptr::null_mut(),
            nodes: Vec::with_capacity(work.len()),
            captures: Vec::new(),
            gpu: dev.gpu.clone(),
        };
        for w in work {
            let mut node: sys::CUgraphNode = std::ptr::null_mut();
            let deps: Vec<sys::CUgraphNode> = me.nodes.last().copied().into_iter().collect();
            match w {
                Work::Launch {
                    kernel,
                    grid,
                    block,
                    args,
                } => {
                    let launch = (*kernel, *grid, *block, args.as_slice());
                    // SAFETY: a kernel of the loaded module with its parameters in
                    // signature order (all 64-bit), copied by the driver.
                    with_kernel_node(dev, launch, |params| unsafe {
                        sys::cuGraphAddKernelNode_v2(
                            &mut node,
                            me.graph,
                            deps.as_ptr(),
                            deps.len(),
                            params,
                        )
                        .result()
                    })
                    .map_err(|e| driver_err("graph kernel node", e))?;
                }
                Work::Gemm(call) => {
                    let child = dev.capture_gemm(call)?;
                    // SAFETY: `child` was captured above; the driver clones it into the
                    // node. Kept for patches back to this call (`captures`).
                    let added = unsafe {
                        sys::cuGraphAddChildGraphNode(
                            &mut node,
                            me.graph,
                            deps.as_ptr(),
                            deps.len(),
                            child,
                        )
                        .result()
                    };
                    me.captures.push((me.nodes.len(), call.clone(), child));
                    added.map_err(|e| driver_err("graph product node", e))?;
                }
            }
            me.nodes.push(node);
        }
        // SAFETY: a complete graph of this context.
        me.exec =
            unsafe { drv::graph::instantiate(me.graph, sys::CUgraphInstantiate_flags_enum(0)) }
                .map_err(|e| driver_err("graph instantiation", e))?;
        Ok(me)
    }

    /// Launches the graph on `stream`.
    pub(crate) fn launch(&self, stream: sys::CUstream) -> Result<()> {
        self.gpu.make_current()?;
        // SAFETY: an instantiated graph of this context; its addresses are live (the
        // executor drops recordings whose arena was freed).
        unsafe { drv::graph::launch(self.exec, stream) }.map_err(|e| driver_err("graph launch", e))
    }

    /// Patches node `index` with `work`'s parameters; false when the driver refuses (a
    /// product whose new sizes cuBLASLt serves with other kernels).
    pub(crate) fn update(&mut self, dev: &CudaDevice, index: usize, work: &Work) -> Result<bool> {
        dev.gpu.make_current()?;
        let node = self.nodes[index];
        match work {
            Work::Launch {
                kernel,
                grid,
                block,
                args,
            } => {
                let launch = (*kernel, *grid, *block, args.as_slice());
                // SAFETY: `node` is a kernel node of this graph; parameters as in `new`.
                let r = with_kernel_node(dev, launch, |params| unsafe {
                    sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, params).result()
                });
                Ok(r.is_ok())
            }
            Work::Gemm(call) => {
                let kept = self
                    .captures
                    .iter()
                    .position(|(i, c, _)| *i == index && c == call);
                let child = match kept {
                    Some(k) => self.captures[k].2,
                    None => dev.capture_gemm(call)?,
                };
                // SAFETY: `node` is a child-graph node of this graph; `child` is ours (the
                // driver copies it into the node).
                let r = unsafe { sys::cuGraphExecChildGraphNodeSetParams(self.exec, node, child) };
                if r.result().is_err() {
                    // Refused (cuBLASLt chose other kernels for new sizes): the executor
                    // records the program again.
                    if kept.is_none() {
                        // SAFETY: captured above, referenced nowhere else.
                        unsafe {
                            let _ = sys::cuGraphDestroy(child);
                        }
                    }
                    return Ok(false);
                }
                if kept.is_none() {
                    self.keep_capture(index, call, child);
                }
                Ok(true)
            }
        }
    }
}

impl GpuGraph {
    /// Keeps `child`, the capture of `call` patched into item `index`, dropping that item's
    /// oldest beyond `KEPT_CAPTURES`.
    fn keep_capture(&mut self, index: usize, call: &GemmCall, child: sys::CUgraph) {
        let of_item = self.captures.iter().filter(|(i, _, _)| *i == index).count();
        if of_item >= KEPT_CAPTURES {
            if let Some(old) = self.captures.iter().position(|(i, _, _)| *i == index) {
                let (_, _, graph) = self.captures.remove(old);
                // SAFETY: a capture of ours; the node holds its own copy.
                unsafe {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
        }
        self.captures.push((index, call.clone(), child));
    }
}

impl Drop for GpuGraph {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: destroyed once; the driver frees an in-flight executable graph when
            // its launch completes.
            unsafe {
                if !self.exec.is_null() {
                    let _ = sys::cuGraphExecDestroy(self.exec);
                }
                let _ = sys::cuGraphDestroy(self.graph);
                for &(_, _, graph) in &self.captures {
                    let _ = sys::cuGraphDestroy(graph);
                }
            }
        }
    }
}

impl CudaDevice {
    /// One product captured (not run) as a graph of its own (its kernel measured first if its
    /// shape is new).
    fn capture_gemm(&self, call: &GemmCall) -> Result<sys::CUgraph> {
        // Measured before the capture begins: a capture cannot wait for timings.
        if self.may_measure() {
            self.tune(call)?;
        }
        let stream = self.gpu.capture_stream;
        let _one_capture = self
            .gpu
            .capture_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // SAFETY: our own stream, captured in thread-local mode so other threads' CUDA
        // calls (torch's) are not affected; the capture is ended on every path.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .result()
            .map_err(|e| driver_err("stream capture", e))?;
            let ran = self.gemm_on(call, stream);
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            let ended = sys::cuStreamEndCapture(stream, &mut graph).result();
            if let Err(e) = ran {
                if !graph.is_null() {
                    let _ = sys::cuGraphDestroy(graph);
                }
                return Err(e);
            }
            ended.map_err(|e| driver_err("stream capture", e))?;
            Ok(graph)
        }
    }
}
