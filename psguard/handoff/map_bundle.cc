// PsguardMapBundle: the tensor of a one-tensor TensorFlow bundle, its buffer a private mapping of the bundle's
// data file instead of a copy (psguard/handoff/mapped.py says why and when; built by `psguard build-op`).
//
// The mapping is MAP_PRIVATE: writes into the tensor (the variable it is assigned to, trained on) copy the page
// they touch into this process and never reach the file. Pages still unwritten show the file's bytes, so the
// file must not change while mapped: psguard's agent never writes a file again once it handed it to a restore.

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/lib/hash/crc32c.h"
#include "tensorflow/core/lib/io/iterator.h"
#include "tensorflow/core/lib/io/table.h"
#include "tensorflow/core/lib/io/table_options.h"
#include "tensorflow/core/protobuf/tensor_bundle.pb.h"
#include "tensorflow/core/util/tensor_bundle/naming.h"

namespace psguard {
namespace {

using ::tensorflow::AllocationDescription;
using ::tensorflow::BundleEntryProto;
using ::tensorflow::DataType;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorBuffer;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

// A tensor buffer that is a mapping of a file: unmapped when the last tensor using it goes.
class MappedBuffer : public TensorBuffer {
 public:
  MappedBuffer(void* base, size_t len) : TensorBuffer(base), len_(len) {}
  size_t size() const override { return len_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(len_);
    proto->set_allocated_bytes(len_);
    proto->set_allocator_name("psguard_mapped_file");
  }

 private:
  ~MappedBuffer() override { munmap(data(), len_); }
  size_t len_;
};

// The entry of `key` in the bundle's index: a table of BundleEntryProto by tensor name, as BundleReader reads it.
absl::Status ReadEntry(const std::string& prefix, const std::string& key, BundleEntryProto* entry) {
  tensorflow::Env* env = tensorflow::Env::Default();
  const std::string index = tensorflow::MetaFilename(prefix);
  uint64_t size = 0;
  TF_RETURN_IF_ERROR(env->GetFileSize(index, &size));
  std::unique_ptr<tensorflow::RandomAccessFile> file;
  TF_RETURN_IF_ERROR(env->NewRandomAccessFile(index, &file));
  tensorflow::table::Table* raw = nullptr;
  TF_RETURN_IF_ERROR(tensorflow::table::Table::Open(tensorflow::table::Options(), file.get(), size, &raw));
  std::unique_ptr<tensorflow::table::Table> table(raw);
  std::unique_ptr<tensorflow::table::Iterator> it(table->NewIterator());
  it->Seek(key);
  TF_RETURN_IF_ERROR(it->status());
  if (!it->Valid() || it->key() != key) return errors::NotFound("bundle ", prefix, " holds no tensor ", key);
  if (!entry->ParseFromArray(it->value().data(), static_cast<int>(it->value().size())))
    return errors::DataLoss("bundle ", prefix, ": its index entry does not parse");
  return absl::OkStatus();
}

class MapBundleOp : public OpKernel {
 public:
  explicit MapBundleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("verify", &verify_));
  }

  void Compute(OpKernelContext* ctx) override {
    const std::string prefix(ctx->input(0).scalar<tensorflow::tstring>()());
    BundleEntryProto entry;
    OP_REQUIRES_OK(ctx, ReadEntry(prefix, key_, &entry));
    OP_REQUIRES(ctx, entry.dtype() == dtype_,
                errors::InvalidArgument("bundle ", prefix, " holds ", tensorflow::DataTypeString(entry.dtype()),
                                        ", not ", tensorflow::DataTypeString(dtype_)));
    OP_REQUIRES(ctx, entry.slices_size() == 0 && entry.shard_id() == 0,
                errors::InvalidArgument("bundle ", prefix, ": a sliced or sharded entry"));
    TensorShape shape;
    OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape(entry.shape(), &shape));
    const uint64_t nbytes = static_cast<uint64_t>(shape.num_elements()) * tensorflow::DataTypeSize(dtype_);
    OP_REQUIRES(ctx, static_cast<uint64_t>(entry.size()) == nbytes && nbytes > 0,
                errors::DataLoss("bundle ", prefix, ": ", entry.size(), " bytes for ", shape.DebugString()));
    OP_REQUIRES(ctx, entry.offset() % static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) == 0,
                errors::InvalidArgument("bundle ", prefix, ": its data is not at a page boundary"));
    const std::string data = tensorflow::DataFilename(prefix, 0, 1);
    const int fd = open(data.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    OP_REQUIRES(ctx, fd >= 0, errors::NotFound("bundle data file ", data, ": ", strerror(errno)));
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < entry.offset() + nbytes) {
      close(fd);
      OP_REQUIRES(ctx, false, errors::DataLoss("bundle data file ", data, " is shorter than its index says"));
    }
    // Read-only first with the page tables filled in one call (no fault per page), then writable: a private
    // mapping made writable and filled at once would copy every page.
    void* base = mmap(nullptr, nbytes, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, entry.offset());
    const int mmap_errno = errno;
    close(fd);
    OP_REQUIRES(ctx, base != MAP_FAILED,
                errors::ResourceExhausted("mapping bundle data file ", data, ": ", strerror(mmap_errno)));
    auto* buffer = new MappedBuffer(base, nbytes);  // owns the mapping from here on
    tensorflow::core::ScopedUnref unref(buffer);
    OP_REQUIRES(ctx, mprotect(base, nbytes, PROT_READ | PROT_WRITE) == 0,
                errors::Internal("making the mapping of ", data, " writable: ", strerror(errno)));
    if (verify_) {
      const uint32_t crc = tensorflow::crc32c::Value(static_cast<const char*>(base), nbytes);
      OP_REQUIRES(ctx, crc == tensorflow::crc32c::Unmask(entry.crc32c()),
                  errors::DataLoss("bundle data file ", data, ": checksum mismatch (damaged or changed)"));
    }
    ctx->set_output(0, Tensor(dtype_, shape, buffer));
  }

 private:
  DataType dtype_;
  std::string key_;
  bool verify_;
};

REGISTER_OP("PsguardMapBundle")
    .Input("prefix: string")
    .Output("value: dtype")
    .Attr("dtype: type")
    .Attr("key: string")
    .Attr("verify: bool = true")
    .SetIsStateful()  // a file read: never folded, deduplicated or moved
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("PsguardMapBundle").Device(tensorflow::DEVICE_CPU), MapBundleOp);

}  // namespace
}  // namespace psguard
