// Tensors: a typed, shaped, strided view over shared storage (heap, mapped file or device).
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "msa/dtype.h"
#include "msa/error.h"

namespace msa {

enum class Device : uint8_t { cpu, cuda };
std::string_view device_name(Device device);

using Shape = std::vector<int64_t>;
std::string shape_string(const Shape& shape);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& shape);  // msa::Error when it does not fit in int64
// "[1, 0, 2]": the multi-index of a flat (row-major) index in `shape`.
std::string index_string(const Shape& shape, int64_t flat_index);

// A tensor is a view: shape and strides (in elements, int64) over storage it co-owns.
// Copying a Tensor copies the view, not the data; `clone()` copies the data.
class Tensor {
 public:
  Tensor() = default;

  // New zero-filled contiguous CPU tensor.
  static Tensor zeros(const Shape& shape, DType dtype);
  // New contiguous CPU tensor filled with `value` (converted to dtype).
  static Tensor full(const Shape& shape, DType dtype, double value);
  // Contiguous view over memory owned elsewhere; `owner` keeps it alive (may be null).
  static Tensor wrap(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner,
                     Device device = Device::cpu);
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return data_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t axis) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw() const { return data_; }
  template <class T>
  T* data() const;  // checks the dtype matches T
  template <class T>
  std::span<T> span() const;  // contiguous only

  // Element access for edges and tests (not for hot loops); index is a flat contiguous index.
  double get(int64_t flat_index) const;
  void set(int64_t flat_index, double value);

  Tensor clone() const;                   // contiguous copy, same dtype
  Tensor to(DType dtype) const;           // contiguous copy converted (exact rounding rules)
  Tensor reshape(const Shape& shape) const;  // contiguous only
  // Sub-range [begin, end) of the leading axis, sharing storage.
  Tensor slice0(int64_t begin, int64_t end) const;

 private:
  void* data_ = nullptr;
  std::shared_ptr<void> owner_;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
};

// The flat index of the first NaN or infinite element of a float tensor (f32, f64, bf16,
// f16, e4m3), or -1 when there is none (always for integer tensors). With
// allow_negative_infinity, -inf passes (the LSE of an empty set). The second form scans
// elements [begin, begin + count) of a contiguous CPU tensor.
int64_t first_non_finite(const Tensor& tensor, bool allow_negative_infinity = false);
int64_t first_non_finite(const Tensor& tensor, int64_t begin, int64_t count,
                         bool allow_negative_infinity = false);

template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

template <class T>
T* Tensor::data() const {
  if (dtype_ != dtype_of<T>())
    throw_arg_error("tensor", std::string("dtype ") + std::string(dtype_name(dtype_of<T>())),
                    dtype_name(dtype_));
  return static_cast<T*>(data_);
}

template <class T>
std::span<T> Tensor::span() const {
  if (!is_contiguous()) throw Error("tensor: expected a contiguous tensor");
  return {data<T>(), static_cast<size_t>(numel())};
}

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  if (shape_numel(shape) != static_cast<int64_t>(values.size()))
    throw_arg_error("values", std::to_string(shape_numel(shape)) + " elements for shape " +
                                  shape_string(shape),
                    values.size());
  Tensor out = zeros(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), out.data<T>());
  return out;
}

}  // namespace msa
