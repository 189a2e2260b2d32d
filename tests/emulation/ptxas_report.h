// ptxas -v and cuobjdump over NVRTC's PTX: per kernel, registers, spills and SASS (no GPU needed).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "file_util.h"
#include "nvrtc.h"

namespace cudagen::testing {

struct KernelResources {
  int registers = 0;
  int spill_bytes = 0;  // stores plus loads
  int stack_bytes = 0;  // the stack frame: local arrays the compiler could not keep in registers, spills
  int static_shared_bytes = 0;  // __shared__ declarations; a generated kernel's is all dynamic, as planned
};

// One SASS instruction: its address, opcode (the part before the first '.',
// as LDGSTS of LDGSTS.E.BYPASS.128), the whole mnemonic and, for a branch,
// its target (-1 else).
struct SassInstruction {
  long address = 0;
  std::string opcode;
  std::string mnemonic;  // HGMMA.64x256x16.F32.BF16
  long target = -1;
  bool predicated = false;  // under a guard (@P0, @!P1, ...)
};

// What ptxas made of a source for one architecture: per kernel, its
// resources (ptxas -v) and, where `disassemble`, its SASS (cuobjdump over
// the same cubin: one compilation serves both).
struct KernelReport {
  std::map<std::string, KernelResources> resources;
  std::map<std::string, std::vector<SassInstruction>> sass;
  std::string ptxas_log;  // ptxas's report, its warnings included

  // Per kernel, how many times each SASS opcode occurs.
  std::map<std::string, std::map<std::string, int>> opcodes() const {
    std::map<std::string, std::map<std::string, int>> out;
    for (const auto& [kernel, instructions] : sass)
      for (const SassInstruction& i : instructions) ++out[kernel][i.opcode];
    return out;
  }
};

inline std::map<std::string, KernelResources> parse_ptxas_report(const std::string& report) {
  // "Compiling entry function 'k0' for 'sm_90'", "N bytes spill stores, N bytes spill loads", "Used N registers".
  std::regex entry(R"(Compiling entry function '(\w+)')"), spill(R"((\d+) bytes spill stores, (\d+) bytes spill loads)"),
      used(R"(Used (\d+) registers)"), stack(R"((\d+) bytes stack frame)"), smem(R"((\d+) bytes smem)");
  std::map<std::string, KernelResources> out;
  std::string kernel;
  std::istringstream lines(report);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, entry)) kernel = m[1];
    if (std::regex_search(line, m, spill)) out[kernel].spill_bytes = std::stoi(m[1]) + std::stoi(m[2]);
    if (std::regex_search(line, m, used)) out[kernel].registers = std::stoi(m[1]);
    if (std::regex_search(line, m, stack)) out[kernel].stack_bytes = std::stoi(m[1]);
    if (std::regex_search(line, m, smem)) out[kernel].static_shared_bytes = std::stoi(m[1]);
  }
  return out;
}

inline std::map<std::string, std::vector<SassInstruction>> parse_sass_listing(const std::string& listing) {
  // "Function : k0_mm", then lines "/*0120*/  @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64], P1 ;"
  // and "/*2580*/  @P2 BRA 0x3270 ;".
  std::regex function(R"(Function : (\w+))"),
      instruction(R"(/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*[^ ]*)\s*(?:(0x[0-9a-f]+))?)");
  std::map<std::string, std::vector<SassInstruction>> out;
  std::string kernel;
  std::istringstream lines(listing);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, function)) {
      kernel = m[1];
    } else if (!kernel.empty() && std::regex_search(line, m, instruction)) {
      SassInstruction i;
      i.address = std::stol(m[1].str(), nullptr, 16);
      i.predicated = m[2].matched;
      i.mnemonic = m[3].str();
      i.opcode = i.mnemonic.substr(0, i.mnemonic.find('.'));
      if (i.opcode == "BRA" && m[4].matched) i.target = std::stol(m[4].str(), nullptr, 16);
      out[kernel].push_back(std::move(i));
    }
  }
  return out;
}

// Compiles `source` to PTX for `arch` with NVRTC, assembles it with
// ptxas -v and, where `disassemble`, lists the cubin's SASS with cuobjdump.
// The toolkit's ptxas (CUDAGEN_PTXAS) assembles, not NVRTC's own: the two
// are of one CUDA release in this build, so the SASS is what the runtime
// loads (a cubin from NVRTC of another release could differ).
inline KernelReport compile_and_report(const std::string& source, const std::string& arch, bool disassemble = true) {
  NvrtcOutput ptx = nvrtc_compile(source, "ptxas_input.cu", arch, /*ptx=*/true);
  std::string text(ptx.binary.begin(), ptx.binary.end());
  text.resize(std::strlen(text.c_str()));  // NVRTC's PTX ends in a NUL, which ptxas refuses
  std::string dir = (std::filesystem::temp_directory_path() / ("cudagen_ptxas_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  write_file_atomic(dir + "/k.ptx", text);
  std::string cmd = std::string(CUDAGEN_PTXAS) + " -arch=" + arch + " -v " + dir + "/k.ptx -o " + dir + "/k.cubin > " +
                    dir + "/ptxas.txt 2>&1";
  KernelReport out;
  int status = std::system(cmd.c_str());
  out.ptxas_log = read_text_file(dir + "/ptxas.txt");
  EXPECT_EQ(status, 0) << out.ptxas_log;
  out.resources = parse_ptxas_report(out.ptxas_log);
  if (disassemble && status == 0) {
    // cuobjdump runs nvdisasm, which lies beside it (cmake/Parts.cmake checks).
    const std::string tools = std::filesystem::path(CUDAGEN_CUOBJDUMP).parent_path().string();
    cmd = "PATH='" + tools + "':\"$PATH\" '" + std::string(CUDAGEN_CUOBJDUMP) + "' -sass " + dir + "/k.cubin > " + dir +
          "/sass.txt 2>&1";
    status = std::system(cmd.c_str());
    const std::string listing = read_text_file(dir + "/sass.txt");
    EXPECT_EQ(status, 0) << listing;
    out.sass = parse_sass_listing(listing);
  }
  std::filesystem::remove_all(dir);
  return out;
}

// Per kernel, its registers, spills, stack and static shared memory; `log`,
// where given, receives ptxas's report.
inline std::map<std::string, KernelResources> ptxas_resources(const std::string& source, const std::string& arch,
                                                              std::string* log = nullptr) {
  KernelReport report = compile_and_report(source, arch, /*disassemble=*/false);
  if (log != nullptr) *log = report.ptxas_log;
  return report.resources;
}

// Per kernel, its SASS instructions in address order.
inline std::map<std::string, std::vector<SassInstruction>> sass_listing(const std::string& source,
                                                                        const std::string& arch) {
  return compile_and_report(source, arch).sass;
}

// Per kernel, how many times each SASS opcode occurs.
inline std::map<std::string, std::map<std::string, int>> sass_opcodes(const std::string& source,
                                                                      const std::string& arch) {
  return compile_and_report(source, arch).opcodes();
}

// A kernel's hottest loop: of its backward branches, the one whose body
// [target, branch] holds the most instructions named `marker` (HMMA: the
// k-loop of a matmul), the smallest such body if several tie; its
// instructions in order. Empty when no loop holds one. A body with an
// unpredicated EXIT in it is no loop: ptxas puts an mbarrier wait's retry
// after the kernel's last instructions, branching back into the loop, so
// that [target, branch] would hold the loop's tail and epilogue too.
inline std::vector<SassInstruction> sass_loop_body(const std::vector<SassInstruction>& instructions,
                                                   const std::string& marker) {
  std::vector<SassInstruction> best;
  int best_marks = 0;
  for (const SassInstruction& branch : instructions) {
    if (branch.target < 0 || branch.target >= branch.address) continue;
    std::vector<SassInstruction> body;
    int marks = 0;
    bool exits = false;
    for (const SassInstruction& i : instructions)
      if (i.address >= branch.target && i.address <= branch.address) {
        body.push_back(i);
        marks += i.opcode == marker;
        exits = exits || (!i.predicated && i.opcode == "EXIT");
      }
    if (exits) continue;
    if (marks > best_marks || (marks == best_marks && marks > 0 && body.size() < best.size())) {
      best = std::move(body);
      best_marks = marks;
    }
  }
  return best;
}

// The same loop's opcodes, counted.
inline std::map<std::string, int> sass_loop(const std::vector<SassInstruction>& instructions, const std::string& marker) {
  std::map<std::string, int> counts;
  for (const SassInstruction& i : sass_loop_body(instructions, marker)) ++counts[i.opcode];
  return counts;
}

}  // namespace cudagen::testing
