// ortflow's ONNX Runtime custom operators, in the domain "ortflow", computed by ATen from the installed
// torch wheel, for the graphs that train.precision: bf16 rewrites (graphs/precision.py).
//
// ortflow.BF16MatMul multiplies two float32 tensors in bfloat16 with float32 accumulation, as
// torch.autocast("cpu", dtype=torch.bfloat16) does: the inputs are rounded to bfloat16 inside the kernel
// and the product, rounded to bfloat16 as autocast's is, comes back widened to float32, so the weights,
// the gradients and every other operator of the graph stay float32.
// Inputs A, B (float32, MatMul's broadcasting rules); attributes transA, transB (int, default 0)
// transpose the last two axes of A or B first, which gives the backward pair without a
// Transpose node: dX = dY * W^T (transB=1), dW = X^T * dY (transA=1). Output Y, float32.
// The product is ATen's at::matmul on bfloat16 tensors: on x86-64 it runs oneDNN's bf16 GEMM
// (AVX512-BF16, or AMX on Intel Sapphire Rapids and later) and falls back to oneDNN's emulation or
// ATen's reference kernel elsewhere, so it computes correctly on any x86-64 CPU. ATen's threads are the
// process's (OMP_NUM_THREADS, torch.set_num_threads), not ONNX Runtime's intra-op pool.
//
// ortflow.FastGeluGrad is com.microsoft's FastGeluGrad (inputs dY, X; output dX, float32): the gradient
// of GELU's tanh approximation, which GPT-2's "gelu_new" becomes, by ATen's vectorized gelu_backward.
// ONNX Runtime 1.19.2's own kernel computes it 10x slower (30.9 against 3.0 ms on [512, 3072], one
// thread, bench/bench_gelu_grad.py): 0.35 s of a GPT-2 124M step (docs/benchmarks.md).
//
// ONNX Runtime's C API headers ship in neither the onnxruntime-training wheel nor any Debian or
// PyPI package this project can install, so the few declarations used are written out here.
// The C API is a binary interface that only grows at its end (ORT_API_VERSION counts the
// releases): each function keeps its place in the OrtApi table, and the OrtCustomOp fields
// keep theirs, so the indices below hold for every release from API version 16 on. They were
// read from include/onnxruntime/core/session/onnxruntime_c_api.h in ONNX Runtime's sources;
// tests/test_bf16_matmul.py runs them against the installed runtime.

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

extern "C" {

struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;

enum OrtErrorCode { ORT_OK, ORT_FAIL, ORT_INVALID_ARGUMENT };
enum { ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1 };
enum { INPUT_OUTPUT_REQUIRED = 0 };
enum { OrtMemTypeDefault = 0 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The OrtCustomOp fields in their order through API version 16, the first to carry
// CreateKernelV2 and KernelComputeV2 (which report errors as an OrtStatus).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
};
}

namespace {

constexpr uint32_t kApiVersion = 16;

// The OrtApi functions used, by their fixed index in the table.
enum ApiIndex : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomain_Add = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
};

const OrtApi* g_api = nullptr;

template <typename Fn>
Fn api(ApiIndex index) {
  return reinterpret_cast<Fn const*>(g_api)[index];
}

struct OrtError : std::exception {
  explicit OrtError(OrtStatus* s) : status(s) {}
  OrtStatus* status;
};

void check(OrtStatus* status) {
  if (status != nullptr) throw OrtError(status);
}

OrtStatus* make_status(OrtErrorCode code, const std::string& message) {
  return api<OrtStatus* (*)(OrtErrorCode, const char*)>(kCreateStatus)(code, message.c_str());
}

// An error from ATen or from the C API as the OrtStatus ONNX Runtime reports to the caller:
// no C++ exception may cross into ONNX Runtime.
template <typename Body>
OrtStatus* guarded(const char* op, Body body) {
  try {
    body();
    return nullptr;
  } catch (const OrtError& e) {
    return e.status;
  } catch (const c10::Error& e) {  // ATen's message without the C++ backtrace that what() appends
    return make_status(ORT_FAIL, std::string("ortflow.") + op + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return make_status(ORT_FAIL, std::string("ortflow.") + op + ": " + e.what());
  }
}

std::vector<int64_t> shape_of(const OrtValue* value) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(api<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(value, &info));
  size_t rank = 0;
  OrtStatus* status = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &rank);
  std::vector<int64_t> dims(rank);
  if (status == nullptr)
    status = api<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims.data(),
                                                                                                       rank);
  api<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  check(status);
  return dims;
}

// A float32 input as an ATen tensor over ONNX Runtime's buffer (no copy).
at::Tensor float_input(OrtKernelContext* context, size_t index) {
  const OrtValue* value = nullptr;
  check(api<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput)(context, index,
                                                                                                         &value));
  void* data = nullptr;
  // GetTensorMutableData is the C API's only accessor; the buffer is read, never written.
  check(api<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(value), &data));
  return at::from_blob(data, shape_of(value), at::kFloat);
}

// A bfloat16 copy of a float32 input, its last two axes swapped (a view) when asked.
at::Tensor bf16_input(OrtKernelContext* context, size_t index, bool transpose) {
  at::Tensor t = float_input(context, index).to(at::kBFloat16);
  if (transpose) {
    TORCH_CHECK(t.dim() >= 2, "transA/transB need an input of rank 2 or more, got rank ", t.dim());
    t = t.transpose(-1, -2);
  }
  return t;
}

// The float32 output of `sizes`, allocated by ONNX Runtime, as an ATen tensor over its buffer.
at::Tensor float_output(OrtKernelContext* context, at::IntArrayRef sizes) {
  OrtValue* output = nullptr;
  check(api<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContext_GetOutput)(
      context, 0, sizes.data(), sizes.size(), &output));
  void* data = nullptr;
  check(api<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(output, &data));
  return at::from_blob(data, sizes, at::kFloat);
}

struct Kernel {
  bool trans_a;
  bool trans_b;
};

int64_t int_attribute(const OrtKernelInfo* info, const char* name) {
  int64_t value = 0;
  using GetInt = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
  OrtStatus* status = api<GetInt>(kKernelInfoGetAttribute_int64)(info, name, &value);
  if (status != nullptr) {  // the attribute is absent: its default
    api<void (*)(OrtStatus*)>(kReleaseStatus)(status);
    return 0;
  }
  return value;
}

OrtStatus* create_matmul(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  return guarded("BF16MatMul", [&] {
    *kernel = new Kernel{int_attribute(info, "transA") != 0, int_attribute(info, "transB") != 0};
  });
}

OrtStatus* compute_matmul(void* op_kernel, OrtKernelContext* context) {
  return guarded("BF16MatMul", [&] {
    const auto* kernel = static_cast<const Kernel*>(op_kernel);
    at::Tensor product = at::matmul(bf16_input(context, 0, kernel->trans_a), bf16_input(context, 1, kernel->trans_b));
    float_output(context, product.sizes()).copy_(product);
  });
}

OrtStatus* create_gelu_grad(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  return guarded("FastGeluGrad", [&] { *kernel = new Kernel{false, false}; });  // no attributes
}

OrtStatus* compute_gelu_grad(void*, OrtKernelContext* context) {
  return guarded("FastGeluGrad", [&] {
    at::Tensor dy = float_input(context, 0), x = float_input(context, 1);
    TORCH_CHECK(dy.sizes() == x.sizes(), "dY and X must have one shape, got ", dy.sizes(), " and ", x.sizes());
    at::Tensor dx = float_output(context, x.sizes());
    at::gelu_backward_out(dx, dy, x, "tanh");
  });
}

// An operator of two float32 inputs and one float32 output, of `name`, `create` and `compute`.
OrtCustomOp make_op(const char* (*name)(const OrtCustomOp*),
                    OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                    OrtStatus* (*compute)(void*, OrtKernelContext*)) {
  OrtCustomOp op{};
  op.version = kApiVersion;
  op.GetName = name;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // the CPU provider
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT}; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t{2}; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT}; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{1}; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return int{INPUT_OUTPUT_REQUIRED}; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return int{INPUT_OUTPUT_REQUIRED}; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return int{OrtMemTypeDefault}; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  return op;
}

// ONNX Runtime keeps pointers to the op and the domain for as long as a session uses them.
const OrtCustomOp g_matmul =
    make_op([](const OrtCustomOp*) { return "BF16MatMul"; }, create_matmul, compute_matmul);
const OrtCustomOp g_gelu_grad =
    make_op([](const OrtCustomOp*) { return "FastGeluGrad"; }, create_gelu_grad, compute_gelu_grad);

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                 const OrtApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  // A runtime older than 1.16 serves no version-16 table and so cannot be handed an error either: the library
  // registers nothing, and a session that uses the op fails on it by name.
  if (g_api == nullptr) return nullptr;
  OrtCustomOpDomain* domain = nullptr;
  return guarded("RegisterCustomOps", [&] {
    check(api<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)("ortflow", &domain));
    for (const OrtCustomOp* op : {&g_matmul, &g_gelu_grad})
      check(api<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomain_Add)(domain, op));
    check(api<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, domain));
  });
}
