// Run-time CPU feature detection for the kernels (isa.h).

#include "isa.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>

namespace edgeinfer_cpu {
namespace {

constexpr std::array<const char*, 5> kNames = {"scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16"};

// libgcc's __builtin_cpu_supports reads CPUID and checks with XGETBV that the OS saves the AVX / AVX-512
// register state, so a feature reported here is safe to execute.
bool cpu_has(Isa level) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  switch (level) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return level == Isa::kScalar;
#endif
}

int parse(const std::string& name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<int>(i);
  TORCH_CHECK(false, "unknown CPU ISA level '", name, "' (scalar, avx2, avx512, avx512_vnni, avx512_bf16)");
}

int cap_from_env() {
  const char* env = std::getenv("EDGEINFER_CPU_ISA");
  return env && *env ? parse(env) : static_cast<int>(Isa::kAvx512Bf16);
}

std::atomic<int>& cap() {
  static std::atomic<int> value{cap_from_env()};
  return value;
}

}  // namespace

bool isa_allows(Isa level) {
  static const std::array<bool, 5> has = {cpu_has(Isa::kScalar), cpu_has(Isa::kAvx2), cpu_has(Isa::kAvx512),
                                          cpu_has(Isa::kAvx512Vnni), cpu_has(Isa::kAvx512Bf16)};
  const int i = static_cast<int>(level);
  return i <= cap().load(std::memory_order_relaxed) && has[i];
}

std::string isa_name() {
  for (int i = static_cast<int>(kNames.size()) - 1; i > 0; --i)
    if (isa_allows(static_cast<Isa>(i))) return kNames[i];
  return kNames[0];
}

void set_isa_cap(const std::string& name) { cap().store(parse(name)); }

}  // namespace edgeinfer_cpu
