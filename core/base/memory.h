// Kinds of memory the engine, backends and transports talk about. No device API here.
#pragma once

#include <string_view>

namespace specontext {

// kHost: pageable host memory (also the CPU backend's "device" memory). kPinnedHost: host memory
// registered with a device runtime (DMA-able, device-addressable). kDevice: accelerator memory.
// kRemote: memory of another node, reachable only through a transport.
enum class MemoryKind { kHost, kPinnedHost, kDevice, kRemote };
inline constexpr int kNumMemoryKinds = 4;

constexpr std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kPinnedHost: return "pinned_host";
    case MemoryKind::kDevice: return "device";
    case MemoryKind::kRemote: return "remote";
  }
  return "unknown";
}

}  // namespace specontext
