// A pickle interpreter for torch.save's state dicts: a fixed opcode set, a fixed allow-list of
// globals, bounded state and no recursion (see torch_pickle.h).
#include "core/model/torch_pickle.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <unordered_map>

namespace specontext {

namespace {

// Bounds on what a pickle may build. A real state dict pickles ~30 objects per tensor.
constexpr size_t kMaxObjects = size_t{1} << 20;
constexpr size_t kMaxStack = size_t{1} << 20;
constexpr size_t kMaxMarks = 1024;
constexpr size_t kMaxMemo = size_t{1} << 20;
constexpr size_t kMaxDims = 16;
constexpr size_t kMaxGlobalPart = 256;  // bytes of a GLOBAL's module or name

constexpr TorchStorageType kStorageTypes[] = {
    {"FloatStorage", "F32", 4, true, DType::kF32},      {"HalfStorage", "F16", 2, true, DType::kF16},
    {"BFloat16Storage", "BF16", 2, true, DType::kBF16}, {"DoubleStorage", "F64", 8, false, DType::kU8},
    {"LongStorage", "I64", 8, true, DType::kI64},       {"IntStorage", "I32", 4, true, DType::kI32},
    {"ShortStorage", "I16", 2, false, DType::kU8},      {"CharStorage", "I8", 1, false, DType::kU8},
    {"ByteStorage", "U8", 1, true, DType::kU8},         {"BoolStorage", "BOOL", 1, false, DType::kU8},
};

// Opcodes (CPython Lib/pickletools.py names).
enum Op : uint8_t {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kBinFloat = 'G',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kBinInt2 = 'M',
  kNone = 'N',
  kBinPersId = 'Q',
  kReduce = 'R',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kAppends = 'e',
  kBinGet = 'h',
  kLongBinGet = 'j',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kSetItems = 'u',
  kEmptyDict = '}',
  kEmptyList = ']',
  kEmptyTuple = ')',
  kProto = 0x80,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
};

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kTuple,
  kList,
  kDict,
  kGlobal,
  kStorage,
  kTensor
};

// The only callables a pickle may name.
enum class Callable : uint8_t {
  kOrderedDict,
  kRebuildTensorV2,
  kRebuildParameter,
  kRebuildParameterWithState,
  kStorageClass
};

struct Object {
  Kind kind = Kind::kNone;
  int64_t i = 0;                                   // kBool / kInt: the value; kStorage: element count
  double f = 0;                                    // kFloat
  Callable callable = Callable::kOrderedDict;      // kGlobal
  const TorchStorageType* storage_type = nullptr;  // kGlobal (kStorageClass), kStorage
  std::string s;                                   // kString; kStorage: the storage key
  std::vector<uint32_t> items;                     // kTuple / kList; kDict: key, value, key, ...
  uint32_t storage = 0;                            // kTensor: its kStorage object
  int64_t offset = 0;                              // kTensor
  std::vector<int64_t> shape, stride;              // kTensor
};

class Machine {
 public:
  Machine(const uint8_t* data, size_t size, const std::string& source)
      : data_(data), size_(size), source_(source) {}

  // Runs to STOP; returns the object STOP pops.
  Result<uint32_t> run() {
    while (pos_ < size_) {
      op_at_ = pos_;
      const uint8_t op = data_[pos_++];
      if (op == kStop) return pop();
      SPX_RETURN_IF_ERROR(step(op));
    }
    return fail("ends without STOP (truncated?)");
  }
  const Object& at(uint32_t i) const { return objects_[i]; }

 private:
  Status fail(const std::string& what) const {
    return invalid_argument(source_ + ": data.pkl at byte " + std::to_string(op_at_) + ": " + what);
  }

  // ---- input ----
  Status need(size_t n) const { return n <= size_ - pos_ ? Status::ok() : fail("truncated operand"); }
  Result<uint64_t> read_le(size_t n) {
    SPX_RETURN_IF_ERROR(need(n));
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(data_[pos_ + k]) << (8 * k);
    pos_ += n;
    return v;
  }
  Result<std::string> read_bytes(uint64_t n) {
    if (n > size_ - pos_) return fail("string of " + std::to_string(n) + " bytes runs past the end");
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  Result<std::string> read_line() {  // GLOBAL's "module\n" and "name\n"
    const size_t limit = std::min(size_ - pos_, kMaxGlobalPart + 1);
    const void* nl = std::memchr(data_ + pos_, '\n', limit);
    if (nl == nullptr)
      return fail("GLOBAL operand without a newline in " + std::to_string(kMaxGlobalPart) + " bytes");
    const size_t n = static_cast<size_t>(static_cast<const uint8_t*>(nl) - (data_ + pos_));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n + 1;
    return s;
  }

  // ---- objects and the stack ----
  Result<uint32_t> make(Object o) {
    if (objects_.size() >= kMaxObjects) return fail("more than " + std::to_string(kMaxObjects) + " objects");
    objects_.push_back(std::move(o));
    return static_cast<uint32_t>(objects_.size() - 1);
  }
  Status push(uint32_t i) {
    if (stack_.size() >= kMaxStack) return fail("stack deeper than " + std::to_string(kMaxStack));
    stack_.push_back(i);
    return Status::ok();
  }
  Status push_new(Object o) {
    SPX_ASSIGN_OR_RETURN(uint32_t i, make(std::move(o)));
    return push(i);
  }
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  Result<uint32_t> pop() {
    if (stack_.size() <= fence()) return fail("stack underflow");
    const uint32_t i = stack_.back();
    stack_.pop_back();
    return i;
  }
  Result<uint32_t> top() const {
    if (stack_.size() <= fence()) return fail("stack underflow");
    return stack_.back();
  }
  // Pops the newest mark; the items above it are stack_[mark, size).
  Result<size_t> pop_mark() {
    if (marks_.empty()) return fail("no MARK to pop");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  Status push_sequence(Kind kind, size_t from) {
    Object o;
    o.kind = kind;
    o.items.assign(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    return push_new(std::move(o));
  }
  Status push_tuple_of(size_t n) {
    if (stack_.size() < fence() + n) return fail("stack underflow");
    return push_sequence(Kind::kTuple, stack_.size() - n);
  }
  Status memo_put(uint64_t key) {
    SPX_ASSIGN_OR_RETURN(uint32_t v, top());
    if (memo_.size() >= kMaxMemo && memo_.find(key) == memo_.end()) {
      return fail("memo larger than " + std::to_string(kMaxMemo));
    }
    memo_[key] = v;
    return Status::ok();
  }
  Status memo_get(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return fail("memo key " + std::to_string(key) + " was never stored");
    return push(it->second);
  }
  Status push_int(int64_t v, Kind kind = Kind::kInt) {
    Object o;
    o.kind = kind;
    o.i = v;
    return push_new(std::move(o));
  }

  // Items stack_[from, size) go into the container at stack_[from - 1].
  Status extend(Kind want, size_t from) {
    if (from == 0 || from - 1 < fence()) return fail("stack underflow");
    Object& target = objects_[stack_[from - 1]];
    if (target.kind != want)
      return fail(want == Kind::kDict ? "SETITEM(S) on a non-dict" : "APPEND(S) on a non-list");
    if (want == Kind::kDict && (stack_.size() - from) % 2 != 0)
      return fail("SETITEMS with an odd item count");
    target.items.insert(target.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    return Status::ok();
  }

  // ---- globals, persistent ids, calls ----
  Status push_global(const std::string& module, const std::string& name) {
    Object o;
    o.kind = Kind::kGlobal;
    if (module == "collections" && name == "OrderedDict") {
      o.callable = Callable::kOrderedDict;
    } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      o.callable = Callable::kRebuildTensorV2;
    } else if (module == "torch._utils" && name == "_rebuild_parameter") {
      o.callable = Callable::kRebuildParameter;
    } else if (module == "torch._utils" && name == "_rebuild_parameter_with_state") {
      o.callable = Callable::kRebuildParameterWithState;
    } else if (module == "torch") {
      for (const TorchStorageType& t : kStorageTypes) {
        if (name == t.class_name) o.storage_type = &t;
      }
      if (o.storage_type == nullptr) return fail("disallowed global 'torch." + name + "'");
      o.callable = Callable::kStorageClass;
    } else {
      return fail("disallowed global '" + module + "." + name +
                  "' (only tensors, OrderedDict and torch storages are read; nothing is executed)");
    }
    return push_new(std::move(o));
  }

  Result<const Object*> arg(const Object& args, size_t k, Kind kind, const char* what) const {
    const Object& a = objects_[args.items[k]];
    if (a.kind != kind) return fail(std::string(what) + " has the wrong type");
    return &a;
  }

  Result<std::vector<int64_t>> int_tuple(const Object& args, size_t k, const char* what) const {
    SPX_ASSIGN_OR_RETURN(const Object* t, arg(args, k, Kind::kTuple, what));
    if (t->items.size() > kMaxDims)
      return fail(std::string(what) + " has more than " + std::to_string(kMaxDims) + " dims");
    std::vector<int64_t> v;
    for (uint32_t i : t->items) {
      const Object& x = objects_[i];
      if (x.kind != Kind::kInt || x.i < 0)
        return fail(std::string(what) + " holds a non-integer or negative entry");
      v.push_back(x.i);
    }
    return v;
  }

  // ('storage', torch.<T>Storage, key, location, numel) -> a storage reference.
  Status persistent_load() {
    SPX_ASSIGN_OR_RETURN(uint32_t pid, pop());
    const Object& t = objects_[pid];
    if (t.kind != Kind::kTuple || t.items.size() != 5) return fail("persistent id is not a 5-tuple");
    const Object& tag = objects_[t.items[0]];
    const Object& cls = objects_[t.items[1]];
    const Object& key = objects_[t.items[2]];
    const Object& numel = objects_[t.items[4]];
    if (tag.kind != Kind::kString || tag.s != "storage") return fail("persistent id is not a 'storage'");
    if (cls.kind != Kind::kGlobal || cls.callable != Callable::kStorageClass) {
      return fail("persistent id does not name a torch storage class");
    }
    if (key.kind != Kind::kString || key.s.empty()) return fail("persistent id has no storage key");
    if (numel.kind != Kind::kInt || numel.i < 0) return fail("persistent id has no element count");
    Object o;
    o.kind = Kind::kStorage;
    o.storage_type = cls.storage_type;
    o.s = key.s;
    o.i = numel.i;
    return push_new(std::move(o));
  }

  Status reduce() {
    SPX_ASSIGN_OR_RETURN(uint32_t args_i, pop());
    SPX_ASSIGN_OR_RETURN(uint32_t fn_i, pop());
    const Object& fn = objects_[fn_i];
    const Object& args = objects_[args_i];
    if (fn.kind != Kind::kGlobal) return fail("REDUCE of a non-callable");
    if (args.kind != Kind::kTuple) return fail("REDUCE arguments are not a tuple");
    const size_t n = args.items.size();
    switch (fn.callable) {
      case Callable::kOrderedDict: {
        if (n != 0) return fail("OrderedDict called with arguments");
        Object d;
        d.kind = Kind::kDict;
        return push_new(std::move(d));
      }
      case Callable::kRebuildTensorV2: {
        // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
        if (n != 6 && n != 7)
          return fail("_rebuild_tensor_v2 takes 6 or 7 arguments, got " + std::to_string(n));
        SPX_ASSIGN_OR_RETURN(const Object* storage, arg(args, 0, Kind::kStorage, "tensor storage"));
        SPX_ASSIGN_OR_RETURN(const Object* offset, arg(args, 1, Kind::kInt, "tensor storage_offset"));
        Object t;
        t.kind = Kind::kTensor;
        t.storage = args.items[0];
        (void)storage;
        t.offset = offset->i;
        if (t.offset < 0) return fail("negative storage_offset");
        SPX_ASSIGN_OR_RETURN(t.shape, int_tuple(args, 2, "tensor size"));
        SPX_ASSIGN_OR_RETURN(t.stride, int_tuple(args, 3, "tensor stride"));
        if (t.shape.size() != t.stride.size()) return fail("tensor size and stride differ in length");
        return push_new(std::move(t));
      }
      case Callable::kRebuildParameter:
      case Callable::kRebuildParameterWithState: {
        // (data, requires_grad, backward_hooks[, state]): the parameter is its data tensor.
        const size_t want = fn.callable == Callable::kRebuildParameter ? 3 : 4;
        if (n != want) return fail("_rebuild_parameter takes " + std::to_string(want) + " arguments");
        if (objects_[args.items[0]].kind != Kind::kTensor) return fail("_rebuild_parameter of a non-tensor");
        return push(args.items[0]);
      }
      case Callable::kStorageClass:
        return fail("a torch storage class is called (only persistent ids may name storages)");
    }
    return fail("unknown callable");
  }

  // BUILD sets attributes: a state dict's _metadata, a parameter's state. Neither carries weights.
  Status build() {
    SPX_ASSIGN_OR_RETURN(uint32_t state, pop());
    (void)state;
    SPX_ASSIGN_OR_RETURN(uint32_t target, top());
    const Kind k = objects_[target].kind;
    if (k != Kind::kDict && k != Kind::kTensor)
      return fail("BUILD on an object that is neither a dict nor a tensor");
    return Status::ok();
  }

  Status step(uint8_t op) {
    switch (op) {
      case kProto: {
        SPX_ASSIGN_OR_RETURN(uint64_t v, read_le(1));
        if (v > 5) return fail("pickle protocol " + std::to_string(v) + " is newer than 5");
        return Status::ok();
      }
      case kFrame:
        return read_le(8).status();  // framing only groups opcodes
      case kMark:
        if (marks_.size() >= kMaxMarks) return fail("MARKs nested deeper than " + std::to_string(kMaxMarks));
        marks_.push_back(stack_.size());
        return Status::ok();
      case kPop:
        return pop().status();
      case kPopMark: {
        SPX_ASSIGN_OR_RETURN(size_t m, pop_mark());
        stack_.resize(m);
        return Status::ok();
      }
      case kEmptyDict:
      case kEmptyList:
      case kEmptyTuple: {
        Object o;
        o.kind = op == kEmptyDict ? Kind::kDict : op == kEmptyList ? Kind::kList : Kind::kTuple;
        return push_new(std::move(o));
      }
      case kTuple: {
        SPX_ASSIGN_OR_RETURN(size_t m, pop_mark());
        return push_sequence(Kind::kTuple, m);
      }
      case kTuple1:
      case kTuple2:
      case kTuple3:
        return push_tuple_of(static_cast<size_t>(op - kTuple1 + 1));
      case kNone:
        return push_new(Object{});
      case kNewTrue:
      case kNewFalse:
        return push_int(op == kNewTrue ? 1 : 0, Kind::kBool);
      case kBinInt: {
        SPX_ASSIGN_OR_RETURN(uint64_t v, read_le(4));
        return push_int(static_cast<int32_t>(static_cast<uint32_t>(v)));
      }
      case kBinInt1:
      case kBinInt2: {
        SPX_ASSIGN_OR_RETURN(uint64_t v, read_le(op == kBinInt1 ? 1 : 2));
        return push_int(static_cast<int64_t>(v));
      }
      case kLong1: {
        SPX_ASSIGN_OR_RETURN(uint64_t n, read_le(1));
        if (n > 8) return fail("LONG1 integer of " + std::to_string(n) + " bytes (more than 64 bits)");
        SPX_ASSIGN_OR_RETURN(uint64_t v, read_le(static_cast<size_t>(n)));
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~uint64_t{0} << (8 * n);  // sign-extend
        return push_int(static_cast<int64_t>(v));
      }
      case kBinFloat: {
        SPX_RETURN_IF_ERROR(need(8));
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | data_[pos_++];  // big-endian
        Object o;
        o.kind = Kind::kFloat;
        std::memcpy(&o.f, &bits, 8);
        return push_new(std::move(o));
      }
      case kBinUnicode:
      case kShortBinUnicode:
      case kBinUnicode8: {
        SPX_ASSIGN_OR_RETURN(uint64_t n, read_le(op == kShortBinUnicode ? 1 : op == kBinUnicode ? 4 : 8));
        Object o;
        o.kind = Kind::kString;
        SPX_ASSIGN_OR_RETURN(o.s, read_bytes(n));
        return push_new(std::move(o));
      }
      case kBinPut:
      case kLongBinPut: {
        SPX_ASSIGN_OR_RETURN(uint64_t k, read_le(op == kBinPut ? 1 : 4));
        return memo_put(k);
      }
      case kMemoize:
        return memo_put(memo_.size());
      case kBinGet:
      case kLongBinGet: {
        SPX_ASSIGN_OR_RETURN(uint64_t k, read_le(op == kBinGet ? 1 : 4));
        return memo_get(k);
      }
      case kGlobal: {
        SPX_ASSIGN_OR_RETURN(std::string module, read_line());
        SPX_ASSIGN_OR_RETURN(std::string name, read_line());
        return push_global(module, name);
      }
      case kStackGlobal: {
        SPX_ASSIGN_OR_RETURN(uint32_t name, pop());
        SPX_ASSIGN_OR_RETURN(uint32_t module, pop());
        if (objects_[name].kind != Kind::kString || objects_[module].kind != Kind::kString) {
          return fail("STACK_GLOBAL of non-strings");
        }
        return push_global(objects_[module].s, objects_[name].s);
      }
      case kBinPersId:
        return persistent_load();
      case kReduce:
        return reduce();
      case kBuild:
        return build();
      case kSetItem:
      case kAppend: {
        const size_t n = op == kSetItem ? 2 : 1;
        if (stack_.size() < fence() + n) return fail("stack underflow");
        return extend(op == kSetItem ? Kind::kDict : Kind::kList, stack_.size() - n);
      }
      case kSetItems:
      case kAppends: {
        SPX_ASSIGN_OR_RETURN(size_t m, pop_mark());
        return extend(op == kSetItems ? Kind::kDict : Kind::kList, m);
      }
      default: {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        return fail(std::string("unsupported pickle opcode ") + hex +
                    " (only what torch.save writes for a dict of tensors is read)");
      }
    }
  }

  const uint8_t* data_;
  size_t size_;
  const std::string& source_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<Object> objects_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, uint32_t> memo_;
};

}  // namespace

Result<std::vector<TorchTensorRecord>> read_torch_pickle(const uint8_t* data, size_t size,
                                                         const std::string& source) {
  Machine m(data, size, source);
  SPX_ASSIGN_OR_RETURN(uint32_t root_i, m.run());
  const Object& root = m.at(root_i);
  if (root.kind != Kind::kDict) {
    return invalid_argument(source + ": data.pkl does not hold a dict of tensors (a state dict)");
  }
  std::vector<TorchTensorRecord> out;
  std::unordered_map<std::string_view, size_t> index;
  for (size_t k = 0; k + 1 < root.items.size(); k += 2) {
    const Object& key = m.at(root.items[k]);
    const Object& value = m.at(root.items[k + 1]);
    if (key.kind != Kind::kString || value.kind != Kind::kTensor) continue;
    const Object& storage = m.at(value.storage);
    TorchTensorRecord r;
    r.name = key.s;
    r.storage_type = storage.storage_type;
    r.storage_key = storage.s;
    r.storage_numel = storage.i;
    r.storage_offset = value.offset;
    r.shape = value.shape;
    r.stride = value.stride;
    auto [it, fresh] = index.emplace(key.s, out.size());
    if (fresh) {
      out.push_back(std::move(r));
    } else {
      out[it->second] = std::move(r);
    }
  }
  return out;
}

}  // namespace specontext
