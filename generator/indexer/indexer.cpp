// The template indexer (docs/architecture.md §5). One translation unit holds the
// prelude and every template file; Clang parses it twice:
//   device:    -x cuda --cuda-device-only, sm_90, with device_shim.h standing
//              in for the CUDA headers (and listing the built-ins allowed);
//   emulation: -x c++ with the host emulation header, as CI compiles it.
// From the AST it takes every top-level definition of the template files
// with its exact source text, what each one uses (functions, also through
// the candidate sets of calls left unresolved in uninstantiated templates;
// types; macros, through preprocessor callbacks), and each CG_OP annotation.
// Uses of the two parses are merged, so a branch that only one configuration
// compiles still brings its callees along.
#include "indexer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <cctype>
#include <set>
#include <sstream>

#include <clang/AST/ASTConsumer.h>
#include <clang/AST/ASTContext.h>
#include <clang/AST/Attr.h>
#include <clang/AST/RecursiveASTVisitor.h>
#include <clang/Frontend/CompilerInstance.h>
#include <clang/Frontend/FrontendAction.h>
#include <clang/Lex/PPCallbacks.h>
#include <clang/Lex/Preprocessor.h>
#include <clang/Tooling/Tooling.h>
#include <fmt/format.h>

#include "annotation.h"
#include "diagnostics.h"
#include "json.h"
#include "registry.h"

namespace cudagen {

std::string_view indexer_device_shim();  // device_shim.h, embedded at build time

namespace {

namespace fs = std::filesystem;

struct TemplateFile {
  std::string path;     // absolute, as Clang reports it
  std::string display;  // as the registry names it: "elementwise.cuh"
  bool prelude = false;
};

// A place in a template file.
struct Place {
  int file = -1;  // index into the file list
  unsigned offset = 0;
  unsigned line = 0, column = 0;
};

// One top-level definition of a template file, copied whole by the emitter.
struct Definition {
  std::string name;
  int file = -1;
  unsigned begin = 0, end = 0;  // byte range of its text in the file
  unsigned line = 0;
  bool macro = false;
  std::vector<std::pair<unsigned, unsigned>> cut;  // CG_OP(...) ranges left out of the text
  std::set<int> uses;                              // indices of other definitions
};

struct FoundOp {
  JsonValue entry;
  std::string function;
  Place place;
  unsigned definition_offset = 0;  // begin of the function's definition
};

// What the indexer reports: Clang's own diagnostics are printed by Clang.
class Errors {
 public:
  explicit Errors(std::ostream& out) : out_(out) {}
  void at(const std::vector<TemplateFile>& files, const Place& p, const std::string& message) {
    out_ << fmt::format("{}:{}:{}: error: {}\n", p.file >= 0 ? files[size_t(p.file)].path : "<templates>", p.line,
                        p.column, message);
    ++count_;
  }
  void general(const std::string& message) {
    out_ << "cudagen-index: error: " << message << "\n";
    ++count_;
  }
  int count() const { return count_; }

 private:
  std::ostream& out_;
  int count_ = 0;
};

// Everything one parse finds, before definitions are matched to uses.
struct ParseResult {
  std::vector<Definition> definitions;             // top-level decls and macros of non-prelude files
  std::vector<std::pair<Place, Place>> uses;       // (where, what it refers to)
  // Calls in uninstantiated templates whose name had no declaration yet (it
  // is declared in a later file): resolved by name once all are known.
  std::vector<std::pair<Place, std::string>> unresolved;
  std::vector<Place> conditionals;                 // #if/#ifdef/#ifndef in non-prelude files
  std::vector<FoundOp> ops;
};

class Locator {
 public:
  Locator(const clang::SourceManager& sm, const std::vector<TemplateFile>& files) : sm_(sm), files_(files) {}

  // Where `loc` is written (the expansion of a macro counts at its call).
  std::optional<Place> place(clang::SourceLocation loc) const {
    if (loc.isInvalid()) return std::nullopt;
    return file_place(sm_.getExpansionLoc(loc));
  }
  // Where a token is spelled (a string literal passed to CG_OP).
  std::optional<Place> spelling(clang::SourceLocation loc) const {
    if (loc.isInvalid()) return std::nullopt;
    return file_place(sm_.getSpellingLoc(loc));
  }
  bool is_template(const std::optional<Place>& p, bool include_prelude) const {
    return p && (include_prelude || !files_[size_t(p->file)].prelude);
  }
  const clang::SourceManager& sm() const { return sm_; }

 private:
  std::optional<Place> file_place(clang::SourceLocation loc) const {
    if (loc.isInvalid() || !loc.isFileID()) return std::nullopt;
    auto entry = sm_.getFileEntryRefForID(sm_.getFileID(loc));
    if (!entry) return std::nullopt;
    std::string path = entry->getName().str();
    for (size_t i = 0; i < files_.size(); ++i)
      if (files_[i].path == path) {
        Place p;
        p.file = int(i);
        p.offset = sm_.getFileOffset(loc);
        p.line = sm_.getExpansionLineNumber(loc);
        p.column = sm_.getExpansionColumnNumber(loc);
        return p;
      }
    return std::nullopt;
  }

  const clang::SourceManager& sm_;
  const std::vector<TemplateFile>& files_;
};

// Macros, conditionals and includes, seen by the preprocessor.
class TemplatePreprocessor : public clang::PPCallbacks {
 public:
  TemplatePreprocessor(const Locator& at, ParseResult& out, Errors& errors, const std::vector<TemplateFile>& files)
      : at_(at), out_(out), errors_(errors), files_(files) {}

  void MacroDefined(const clang::Token& name, const clang::MacroDirective* md) override {
    const clang::MacroInfo* mi = md->getMacroInfo();
    auto p = at_.place(mi->getDefinitionLoc());
    if (!at_.is_template(p, false)) return;
    // From the '#' at the start of its line to the end of its last token.
    const clang::SourceManager& sm = at_.sm();
    auto end = at_.place(clang::Lexer::getLocForEndOfToken(mi->getDefinitionEndLoc(), 0, sm, {}));
    Definition d;
    d.name = name.getIdentifierInfo()->getName().str();
    d.file = p->file;
    d.begin = p->offset - (p->column - 1);
    d.end = end ? end->offset : p->offset;
    d.line = p->line;
    d.macro = true;
    out_.definitions.push_back(std::move(d));
  }

  void MacroExpands(const clang::Token&, const clang::MacroDefinition& md, clang::SourceRange range,
                    const clang::MacroArgs*) override {
    const clang::MacroInfo* mi = md.getMacroInfo();
    if (mi == nullptr) return;
    auto defined = at_.place(mi->getDefinitionLoc());
    auto used = at_.place(range.getBegin());
    if (at_.is_template(defined, false) && used) out_.uses.push_back({*used, *defined});
  }

  void If(clang::SourceLocation loc, clang::SourceRange, ConditionValueKind) override { conditional(loc); }
  void Ifdef(clang::SourceLocation loc, const clang::Token&, const clang::MacroDefinition&) override { conditional(loc); }
  void Ifndef(clang::SourceLocation loc, const clang::Token&, const clang::MacroDefinition&) override {
    conditional(loc);
  }

  void InclusionDirective(clang::SourceLocation hash, const clang::Token&, llvm::StringRef name, bool,
                          clang::CharSourceRange, clang::OptionalFileEntryRef, llvm::StringRef, llvm::StringRef,
                          const clang::Module*, bool, clang::SrcMgr::CharacteristicKind) override {
    auto p = at_.place(hash);
    if (at_.is_template(p, true))
      errors_.at(files_, *p,
                 fmt::format("templates must not #include (\"{}\"): a generated .cu is standalone, so a template may "
                             "use only the prelude, other templates and the CUDA built-ins of the indexer's shim",
                             name.str()));
  }

 private:
  void conditional(clang::SourceLocation loc) {
    auto p = at_.place(loc);
    if (at_.is_template(p, false)) out_.conditionals.push_back(*p);
  }

  const Locator& at_;
  ParseResult& out_;
  Errors& errors_;
  const std::vector<TemplateFile>& files_;
};

// What one top-level declaration refers to: functions (and every candidate of
// a call that an uninstantiated template leaves unresolved), variables,
// types and templates.
class UseCollector : public clang::RecursiveASTVisitor<UseCollector> {
 public:
  UseCollector(const Locator& at, const Place& from, ParseResult& out) : at_(at), from_(from), out_(out) {}

  bool VisitDeclRefExpr(clang::DeclRefExpr* e) {
    add(e->getDecl());
    return true;
  }
  bool VisitOverloadExpr(clang::OverloadExpr* e) {
    for (clang::NamedDecl* d : e->decls()) add(d);
    if (e->decls().empty()) out_.unresolved.push_back({from_, e->getName().getAsString()});
    return true;
  }
  bool VisitCXXConstructExpr(clang::CXXConstructExpr* e) {
    if (e->getConstructor()) add(e->getConstructor()->getParent());
    return true;
  }
  bool VisitTagTypeLoc(clang::TagTypeLoc tl) {
    add(tl.getDecl());
    return true;
  }
  bool VisitTypedefTypeLoc(clang::TypedefTypeLoc tl) {
    add(tl.getTypedefNameDecl());
    return true;
  }
  bool VisitTemplateSpecializationTypeLoc(clang::TemplateSpecializationTypeLoc tl) {
    add(tl.getTypePtr()->getTemplateName().getAsTemplateDecl());
    return true;
  }

 private:
  // A declaration and its other declarations (a prototype's body may be
  // elsewhere); the location of an instantiation is that of its pattern.
  void add(const clang::Decl* d) {
    if (d == nullptr) return;
    for (const clang::Decl* r : d->redecls()) add_one(r);
    if (auto* fd = llvm::dyn_cast<clang::FunctionDecl>(d)) {
      if (auto* primary = fd->getPrimaryTemplate()) add_one(primary);
      if (auto* def = fd->getDefinition()) add_one(def);
    }
    if (auto* ftd = llvm::dyn_cast<clang::FunctionTemplateDecl>(d))
      if (auto* def = ftd->getTemplatedDecl()->getDefinition()) add_one(def);
  }
  void add_one(const clang::Decl* d) {
    auto p = at_.place(d->getLocation());
    if (at_.is_template(p, false)) out_.uses.push_back({from_, *p});
  }

  const Locator& at_;
  Place from_;
  ParseResult& out_;
};

std::string decl_kind(const clang::Decl* d) {
  if (llvm::isa<clang::VarDecl>(d)) return "a variable";
  if (llvm::isa<clang::FieldDecl>(d)) return "a field";
  if (llvm::isa<clang::TypeDecl>(d)) return "a type";
  if (llvm::isa<clang::ParmVarDecl>(d)) return "a parameter";
  return "a declaration";
}

// The strings of a CG_OP annotation, each with where it is spelled.
bool annotation_strings(const clang::AnnotateAttr* attr, const Locator& at, std::vector<std::string>& strings,
                        std::vector<std::optional<Place>>& places) {
  for (clang::Expr* e : attr->args()) {
    const clang::Expr* inner = e->IgnoreParenImpCasts();
    if (auto* c = llvm::dyn_cast<clang::ConstantExpr>(inner)) inner = c->getSubExpr()->IgnoreParenImpCasts();
    auto* literal = llvm::dyn_cast<clang::StringLiteral>(inner);
    if (literal == nullptr) return false;
    strings.push_back(literal->getString().str());
    places.push_back(at.spelling(e->getBeginLoc()));
  }
  return true;
}

bool is_integer_type(clang::QualType t) { return t->isIntegerType() && !t->isBooleanType(); }

// The emitter calls an elementwise op's function with its inputs in slot
// order (the element index first when it has none), then its arguments in
// order (a string argument as the index of its choice); an input the op
// updates in place (an optimizer's parameter) is passed by reference, and
// the output is the return value. Checks that the function's parameters
// say the same as the annotation.
std::string check_elementwise_parameters(const clang::FunctionDecl* fd, const OpSignature& op) {
  struct Expected {
    std::string name;
    std::string what;
    enum { value, reference, index, float_, int_, bool_, choice } kind;
  };
  std::vector<Expected> expected;
  int outputs = 0;
  for (const auto& s : op.tensors) {
    if (s.role == SlotRole::output || s.role == SlotRole::scratch) {
      ++outputs;
      continue;
    }
    expected.push_back({s.name, "tensor slot '" + s.name + "'", s.writes ? Expected::reference : Expected::value});
  }
  if (expected.empty()) expected.push_back({"", "the element index (no input slot)", Expected::index});
  for (const auto& a : op.args) {
    auto kind = a.type == ArgType::float_  ? Expected::float_
                : a.type == ArgType::int_  ? Expected::int_
                : a.type == ArgType::bool_ ? Expected::bool_
                                           : Expected::choice;
    if (a.type == ArgType::ints || a.type == ArgType::floats)
      return fmt::format("argument '{}' is an array, which an elementwise function cannot take", a.name);
    expected.push_back({a.name, "argument '" + a.name + "'", kind});
  }
  const std::string fn = fd->getNameAsString();
  if (fd->getNumParams() != expected.size()) {
    std::vector<std::string> names;
    for (const auto& e : expected) names.push_back(e.name.empty() ? "index" : e.name);
    return fmt::format("{} takes {} parameters, but the annotation gives {} ({}): the emitter passes the inputs in slot "
                       "order, then the arguments",
                       fn, fd->getNumParams(), expected.size(), fmt::join(names, ", "));
  }
  for (unsigned i = 0; i < fd->getNumParams(); ++i) {
    const clang::ParmVarDecl* p = fd->getParamDecl(i);
    const Expected& e = expected[i];
    const std::string name = p->getNameAsString();
    if (e.kind != Expected::index && name != e.name)
      return fmt::format("parameter {} of {} is '{}', but the annotation's {} comes there", i + 1, fn, name, e.what);
    clang::QualType t = p->getType();
    bool dependent = t->isDependentType();
    bool ok = true;
    switch (e.kind) {
      case Expected::value: ok = !t->isReferenceType() && !t->isPointerType(); break;
      case Expected::reference: ok = t->isLValueReferenceType() && !t.getNonReferenceType().isConstQualified(); break;
      case Expected::index: ok = dependent || is_integer_type(t); break;
      case Expected::float_: ok = dependent || t->isRealFloatingType(); break;
      case Expected::int_: ok = dependent || is_integer_type(t); break;
      case Expected::bool_: ok = dependent || t->isBooleanType(); break;
      case Expected::choice: ok = dependent || is_integer_type(t); break;
    }
    if (!ok) {
      static const char* wanted[] = {"a value (not a pointer or reference)", "a non-const reference (it is written)",
                                     "an integer (the element index)",       "a floating-point type",
                                     "an integer type",                      "bool",
                                     "an integer (the index of the chosen string)"};
      return fmt::format("parameter '{}' of {} has type '{}', which cannot carry {}: it must be {}", name, fn,
                         t.getAsString(), e.what, wanted[e.kind]);
    }
  }
  const bool returns = !fd->getReturnType()->isVoidType();
  if (outputs == 1 && !returns) return fmt::format("{} returns nothing, but the op has an output slot", fn);
  if (outputs == 0 && returns) return fmt::format("{} returns a value, but the op has no output slot to store it", fn);
  if (outputs > 1) return "an elementwise op has at most one output slot (others are updated through references)";
  return {};
}

class IndexConsumer : public clang::ASTConsumer {
 public:
  IndexConsumer(const std::vector<TemplateFile>& files, ParseResult& out, Errors& errors, bool device)
      : files_(files), out_(out), errors_(errors), device_(device) {}

  void HandleTranslationUnit(clang::ASTContext& ctx) override {
    Locator at(ctx.getSourceManager(), files_);
    for (clang::Decl* d : ctx.getTranslationUnitDecl()->decls()) {
      auto begin = at.place(d->getBeginLoc());
      if (!at.is_template(begin, true)) continue;
      if (!files_[size_t(begin->file)].prelude) record_definition(at, d, *begin, ctx);
      find_annotations(at, d);
    }
  }

 private:
  void record_definition(const Locator& at, clang::Decl* d, const Place& begin, clang::ASTContext& ctx) {
    const clang::SourceManager& sm = ctx.getSourceManager();
    clang::SourceLocation end_token = sm.getExpansionRange(d->getEndLoc()).getEnd();
    auto end = at.place(clang::Lexer::getLocForEndOfToken(end_token, 0, sm, ctx.getLangOpts()));
    if (!end) return;
    Definition def;
    auto* named = llvm::dyn_cast<clang::NamedDecl>(d);
    def.name = named ? named->getNameAsString() : "";
    def.file = begin.file;
    def.begin = begin.offset;
    def.end = end->offset;
    def.line = begin.line;
    if (auto* ftd = llvm::dyn_cast<clang::FunctionTemplateDecl>(d)) cut_annotations(at, ftd->getTemplatedDecl(), def);
    if (auto* fd = llvm::dyn_cast<clang::FunctionDecl>(d)) cut_annotations(at, fd, def);
    // Definitions that share a declaration statement (int a, b;) are one text.
    if (!out_.definitions.empty() && out_.definitions.back().file == def.file &&
        out_.definitions.back().begin == def.begin)
      return;
    UseCollector(at, begin, out_).TraverseDecl(d);
    out_.definitions.push_back(std::move(def));
  }

  void cut_annotations(const Locator& at, const clang::Decl* d, Definition& def) {
    for (const auto* attr : d->specific_attrs<clang::AnnotateAttr>()) {
      if (attr->getAnnotation() != "cudagen.op") continue;
      clang::CharSourceRange r = at.sm().getExpansionRange(attr->getLocation());
      auto b = at.place(r.getBegin());
      auto e = at.place(clang::Lexer::getLocForEndOfToken(r.getEnd(), 0, at.sm(), {}));
      if (b && e) def.cut.push_back({b->offset, e->offset});
    }
  }

  void find_annotations(const Locator& at, clang::Decl* d) {
    // Annotations anywhere in the declaration: a method or a variable is an error.
    struct Finder : clang::RecursiveASTVisitor<Finder> {
      std::vector<std::pair<clang::Decl*, const clang::AnnotateAttr*>> annotated;
      bool VisitDecl(clang::Decl* d) {
        for (const auto* a : d->specific_attrs<clang::AnnotateAttr>())
          if (a->getAnnotation() == "cudagen.op") annotated.push_back({d, a});
        return true;
      }
    } finder;
    finder.TraverseDecl(d);
    for (const auto& [annotated, attr] : finder.annotated) annotation(at, annotated, attr, d);
  }

  // One CG_OP annotation `attr` on `d` (a declaration may carry other annotate attributes too).
  void annotation(const Locator& at, clang::Decl* d, const clang::AnnotateAttr* attr, clang::Decl* top) {
    auto where = at.place(attr->getLocation());
    if (!where) return;
    auto* fd = llvm::dyn_cast<clang::FunctionDecl>(d);
    if (fd == nullptr || llvm::isa<clang::CXXMethodDecl>(fd)) {
      errors_.at(files_, *where,
                 fmt::format("CG_OP annotates {}{}, not a device function: an op is a free function "
                             "(template <...> CG_OP(...) CG_DEVICE T cg_op(...))",
                             fd ? "a member function" : decl_kind(d),
                             llvm::isa<clang::NamedDecl>(d)
                                 ? " '" + llvm::cast<clang::NamedDecl>(d)->getNameAsString() + "'"
                                 : std::string()));
      return;
    }
    if (device_ && (!fd->hasAttr<clang::CUDADeviceAttr>() || fd->hasAttr<clang::CUDAGlobalAttr>())) {
      errors_.at(files_, *where,
                 fmt::format("CG_OP annotates '{}', which is not a __device__ function: declare it CG_DEVICE",
                             fd->getNameAsString()));
      return;
    }
    if (!device_) return;  // the emulation parse only adds uses
    std::vector<std::string> strings;
    std::vector<std::optional<Place>> places;
    if (!annotation_strings(attr, at, strings, places)) {
      errors_.at(files_, *where, "CG_OP takes string literals only: CG_OP(\"name\", \"key: value\", ...)");
      return;
    }
    FoundOp op;
    op.function = fd->getNameAsString();
    op.place = *at.place(fd->getLocation());
    op.definition_offset = at.place(top->getBeginLoc())->offset;
    try {
      op.entry = parse_op_annotation(strings);
    } catch (const AnnotationError& e) {
      const Place& p = e.index < places.size() && places[e.index] ? *places[e.index] : *where;
      errors_.at(files_, p, fmt::format("op '{}': {}", strings.empty() ? "?" : strings[0], e.what()));
      return;
    }
    JsonValue source = JsonValue::object();
    source.set("file", JsonValue::string(files_[size_t(op.place.file)].display));
    source.set("function", JsonValue::string(op.function));
    source.set("line", JsonValue::integer(op.place.line));
    op.entry.set("source", std::move(source));
    // The entry must read as a registry entry: the same checks as any
    // registry. Links to other ops and variants are checked once all are known.
    JsonValue alone = JsonValue::object();
    for (const auto& [key, value] : op.entry.members())
      if (key != "backward" && key != "forward" && key != "init" && key != "inverse" && key != "variants")
        alone.set(key, value);
    if (const JsonValue* variants = op.entry.find("variants")) {  // named only: a reference function is one
      JsonValue named = JsonValue::array();
      for (const auto& v : variants->items()) {
        JsonValue variant = JsonValue::object();
        variant.set("function", v);
        named.push_back(std::move(variant));
      }
      alone.set("variants", std::move(named));
    }
    JsonValue one = JsonValue::object();
    one.set("format", JsonValue::string("cudagen.registry/1"));
    JsonValue ops = JsonValue::array();
    ops.push_back(std::move(alone));
    one.set("ops", std::move(ops));
    OpRegistry parsed;
    try {
      parsed = OpRegistry::from_json(write_json(one), "annotation");
    } catch (const CompileError& e) {
      for (const auto& d : e.diagnostics().errors())
        errors_.at(files_, *where, fmt::format("{} (in the CG_OP annotation of {})", d.message, op.function));
      return;
    }
    const OpSignature& sig = parsed.ops().front();
    if (sig.pattern == PatternKind::elementwise || sig.pattern == PatternKind::broadcast) {
      std::string mismatch = check_elementwise_parameters(fd, sig);
      if (!mismatch.empty()) {
        errors_.at(files_, op.place, fmt::format("op '{}': {}", sig.name, mismatch));
        return;
      }
    }
    out_.ops.push_back(std::move(op));
  }

  const std::vector<TemplateFile>& files_;
  ParseResult& out_;
  Errors& errors_;
  bool device_;
};

class IndexAction : public clang::ASTFrontendAction {
 public:
  IndexAction(const std::vector<TemplateFile>& files, ParseResult& out, Errors& errors, bool device)
      : files_(files), out_(out), errors_(errors), device_(device) {}

  std::unique_ptr<clang::ASTConsumer> CreateASTConsumer(clang::CompilerInstance& ci, llvm::StringRef) override {
    locator_ = std::make_unique<Locator>(ci.getSourceManager(), files_);
    ci.getPreprocessor().addPPCallbacks(std::make_unique<TemplatePreprocessor>(*locator_, out_, errors_, files_));
    return std::make_unique<IndexConsumer>(files_, out_, errors_, device_);
  }

 private:
  const std::vector<TemplateFile>& files_;
  ParseResult& out_;
  Errors& errors_;
  bool device_;
  std::unique_ptr<Locator> locator_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The text the emitter copies: the comment lines right above the
// definition, then the definition without its CG_OP annotation.
std::string definition_text(const std::string& file_text, const Definition& d) {
  size_t begin = d.begin;
  // Back over whole lines of // comments directly above.
  size_t line_start = file_text.rfind('\n', begin == 0 ? 0 : begin - 1);
  line_start = line_start == std::string::npos ? 0 : line_start + 1;
  begin = line_start;
  while (begin > 0) {
    size_t prev_end = begin - 1;  // the '\n' ending the previous line
    size_t prev_start = file_text.rfind('\n', prev_end == 0 ? 0 : prev_end - 1);
    prev_start = prev_start == std::string::npos || prev_end == 0 ? 0 : prev_start + 1;
    std::string_view line(file_text.data() + prev_start, prev_end - prev_start);
    size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line.substr(first, 2) != "//") break;
    begin = prev_start;
  }
  size_t end = d.end;
  // A declaration's ';' and the rest of its line.
  while (end < file_text.size() && (file_text[end] == ';' || file_text[end] == ' ')) ++end;
  std::string out;
  size_t at = begin;
  auto cuts = d.cut;
  std::sort(cuts.begin(), cuts.end());
  for (auto [b, e] : cuts) {
    out.append(file_text, at, b - at);
    at = e;
    // An annotation on lines of its own leaves no blank line behind.
    size_t ls = out.find_last_not_of(" \t");
    if ((ls == std::string::npos || out[ls] == '\n') && at < file_text.size() && file_text[at] == '\n') {
      out.resize(ls == std::string::npos ? 0 : ls + 1);
      ++at;
    }
  }
  out.append(file_text, at, end - at);
  return out + "\n";
}

std::vector<TemplateFile> list_files(const IndexOptions& options, Errors& errors) {
  std::vector<TemplateFile> files;
  std::error_code ec;
  std::string prelude = fs::weakly_canonical(options.prelude, ec).string();
  if (ec || !fs::is_regular_file(prelude)) {
    errors.general(fmt::format("no prelude at '{}' (--prelude FILE; the bundled one is templates/prelude.cuh)",
                               options.prelude));
    return files;
  }
  files.push_back({prelude, "prelude.cuh", true});
  std::set<std::string> displays;
  for (const auto& dir : options.template_dirs) {
    if (!fs::is_directory(dir, ec)) {
      errors.general(fmt::format("'{}' is not a folder of templates (*.cuh)", dir));
      continue;
    }
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.is_regular_file() && entry.path().extension() == ".cuh") names.push_back(entry.path().filename());
    std::sort(names.begin(), names.end());
    for (const auto& name : names) {
      std::string path = fs::weakly_canonical(fs::path(dir) / name).string();
      if (path == prelude) continue;
      if (!displays.insert(name).second) {
        errors.general(fmt::format("two template files are named '{}' ({}): the registry names files by their name",
                                   name, path));
        continue;
      }
      files.push_back({path, name, false});
    }
  }
  return files;
}

// The inclusion directives of a template file (#include, #include_next,
// #import, #embed), found in its text before Clang sees it: refused there,
// the file they name is never read, so none of its lines can appear in
// Clang's diagnostics (a template including a file of secrets had them
// echoed as syntax errors). As the preprocessor sees the text: line splices
// joined, comments blank, quoted text skipped, a directive only where '#' is
// the first token of its line.
std::vector<std::pair<Place, std::string>> inclusion_directives(const std::string& text, int file) {
  struct Char {
    char c;
    unsigned offset, line, column;
  };
  std::vector<Char> chars;  // the text with its line splices joined
  unsigned line = 1, column = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == '\n') {
      ++i;
      ++line;
      column = 1;
      continue;
    }
    chars.push_back({text[i], unsigned(i), line, column});
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  auto at = [&](size_t i) { return i < chars.size() ? chars[i].c : '\0'; };
  auto identifier_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  std::vector<std::pair<Place, std::string>> found;
  bool first_token = true;  // nothing but blanks and comments so far on this line
  size_t hash = SIZE_MAX;  // the '#' that starts this line's directive, if any
  for (size_t i = 0; i < chars.size(); ++i) {
    const char c = at(i);
    if (c == '/' && at(i + 1) == '*') {
      for (i += 2; i < chars.size() && !(at(i) == '*' && at(i + 1) == '/'); ++i) {
      }
      ++i;
      continue;
    }
    if (c == '/' && at(i + 1) == '/') {
      while (i + 1 < chars.size() && at(i + 1) != '\n') ++i;
      continue;
    }
    if (c == '\n') {
      first_token = true;
      hash = SIZE_MAX;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v') continue;
    if (first_token && c == '#') {
      first_token = false;
      hash = i;
      continue;
    }
    if (hash != SIZE_MAX && identifier_char(c)) {
      std::string name;
      for (; identifier_char(at(i)); ++i) name += at(i);
      --i;
      if (name == "include" || name == "include_next" || name == "import" || name == "embed") {
        std::string operand;  // what it names, for the message
        for (size_t j = i + 1; j < chars.size() && at(j) != '\n' && operand.size() < 100; ++j)
          operand += static_cast<unsigned char>(at(j)) < 0x20 || at(j) == 0x7f ? '?' : at(j);
        operand.erase(0, operand.find_first_not_of(" \t"));
        operand.erase(operand.find_last_not_of(" \t\r") + 1);
        const Char& h = chars[hash];
        found.push_back({Place{file, h.offset, h.line, h.column}, "#" + name + " " + operand});
      }
    } else if (c == '"' || c == '\'') {  // quoted text, to the closing quote or the line's end
      for (++i; i < chars.size() && at(i) != c && at(i) != '\n'; ++i)
        if (at(i) == '\\') ++i;
      if (at(i) == '\n') --i;
    }
    first_token = false;
    hash = SIZE_MAX;
  }
  return found;
}

bool parse(const std::vector<TemplateFile>& files, const IndexOptions& options, bool device, ParseResult& out,
           Errors& errors) {
  std::string code;
  for (const auto& f : files) code += "#include \"" + f.path + "\"\n";
  std::vector<std::string> args = {"-fsyntax-only", "-DCUDAGEN_INDEXER", "-Wall", "-Wno-unused-function"};
  if (!options.resource_dir.empty()) args.push_back("-resource-dir=" + options.resource_dir);
  clang::tooling::FileContentMappings virtual_files;
  if (device) {
    args.insert(args.end(), {"-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_90", "-nocudainc", "-nocudalib",
                             "-Wno-unknown-cuda-version", "-std=c++17", "-include", "/cudagen-index/device_shim.h"});
    virtual_files.push_back({"/cudagen-index/device_shim.h", std::string(indexer_device_shim())});
  } else {
    args.insert(args.end(), {"-x", "c++", "-std=c++17", "-include", options.emu_header});
  }
  return clang::tooling::runToolOnCodeWithArgs(std::make_unique<IndexAction>(files, out, errors, device), code, args,
                                               device ? "/cudagen-index/templates.cu" : "/cudagen-index/templates.cpp",
                                               "cudagen-index", std::make_shared<clang::PCHContainerOperations>(),
                                               virtual_files);
}

// The definition whose text holds `p`, or -1.
int definition_at(const std::vector<Definition>& defs, const Place& p) {
  for (size_t i = 0; i < defs.size(); ++i)
    if (defs[i].file == p.file && defs[i].begin <= p.offset && p.offset < defs[i].end) return int(i);
  return -1;
}

}  // namespace

IndexResult index_templates(const IndexOptions& options, std::ostream& diagnostics) {
  IndexResult result;
  Errors errors(diagnostics);
  std::vector<TemplateFile> files = list_files(options, errors);
  if (errors.count()) return result;
  for (size_t f = 0; f < files.size(); ++f) {
    std::ifstream in(files[f].path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const auto& [place, directive] : inclusion_directives(text, int(f)))
      errors.at(files, place,
                fmt::format("templates must not include other files ({}): a generated .cu is standalone, so a "
                            "template may use only the prelude, other templates and the CUDA built-ins of the "
                            "indexer's shim",
                            directive));
  }
  if (errors.count()) return result;  // before Clang reads what they name

  ParseResult device, emulation;
  bool device_ok = parse(files, options, true, device, errors);
  bool emulation_ok = device_ok && parse(files, options, false, emulation, errors);
  if (!device_ok || !emulation_ok) {
    diagnostics << fmt::format("cudagen-index: the templates do not compile in the {} configuration; see above\n",
                               device_ok ? "host emulation" : "device (sm_90)");
    return result;
  }

  // Definitions in file order; macros and declarations interleave by offset.
  std::vector<Definition> defs = std::move(device.definitions);
  std::stable_sort(defs.begin(), defs.end(),
                   [](const Definition& a, const Definition& b) { return std::tie(a.file, a.begin) < std::tie(b.file, b.begin); });
  for (const ParseResult* parse : {&device, &emulation})
    for (const auto& [from, to] : parse->uses) {
      int a = definition_at(defs, from), b = definition_at(defs, to);
      if (a >= 0 && b >= 0 && a != b) defs[size_t(a)].uses.insert(b);
    }
  for (const ParseResult* parse : {&device, &emulation})
    for (const auto& [from, name] : parse->unresolved) {
      int a = definition_at(defs, from);
      for (size_t b = 0; a >= 0 && b < defs.size(); ++b)
        if (!defs[b].macro && defs[b].name == name && int(b) != a) defs[size_t(a)].uses.insert(int(b));
    }
  for (const auto& c : device.conditionals)
    if (definition_at(defs, c) < 0)
      errors.at(files, c,
                "a preprocessor conditional outside any definition: the emitter copies whole definitions, so put the "
                "condition inside the function body (or in the prelude)");

  // The order the emitter writes them in: what a definition uses comes
  // before it (a template may call a function of a later file), file order
  // otherwise.
  std::vector<int> order;
  {
    std::vector<int> state(defs.size(), 0);  // 0 new, 1 on the path, 2 placed
    std::function<void(int)> place = [&](int d) {
      if (state[size_t(d)]) return;
      state[size_t(d)] = 1;
      for (int u : defs[size_t(d)].uses) place(u);
      state[size_t(d)] = 2;
      order.push_back(d);
    };
    for (size_t d = 0; d < defs.size(); ++d) place(int(d));
  }
  std::vector<int> rank(defs.size());
  for (size_t i = 0; i < order.size(); ++i) rank[size_t(order[i])] = int(i);

  // Ids: the name, and name/2, name/3 for later overloads; macros as #NAME.
  std::vector<std::string> ids;
  std::map<std::string, int> seen;
  for (const auto& d : defs) {
    std::string base = d.macro ? "#" + d.name : (d.name.empty() ? "<unnamed>" : d.name);
    int n = ++seen[base];
    ids.push_back(n == 1 ? base : fmt::format("{}/{}", base, n));
  }

  std::map<std::string, const FoundOp*> by_name;
  for (const auto& op : device.ops) {
    const std::string& name = op.entry.find("name")->as_string();
    auto [it, fresh] = by_name.emplace(name, &op);
    if (!fresh)
      errors.at(files, op.place,
                fmt::format("op '{}' is declared twice: here and at {}:{}", name, files[size_t(it->second->place.file)].path,
                            it->second->place.line));
  }
  for (const auto& [name, op] : by_name)
    for (const char* link : {"backward", "forward", "init", "inverse"})
      if (const JsonValue* target = op->entry.find(link))
        for (const std::string& linked : split_op_names(target->as_string()))  // (backward: one or more)
          if (!by_name.count(linked))
            errors.at(files, op->place,
                      fmt::format("op '{}' names {} op '{}', but no template declares an op of that name", name, link,
                                  linked));
  if (errors.count()) return result;

  // The closure of a definition: itself and everything it reaches, ids in emission order.
  auto closure_of = [&](int start) {
    std::set<int> closure;
    std::vector<int> work{start};
    while (!work.empty()) {
      int d = work.back();
      work.pop_back();
      if (!closure.insert(d).second) continue;
      for (int u : defs[size_t(d)].uses) work.push_back(u);
    }
    std::vector<int> sorted(closure.begin(), closure.end());
    std::sort(sorted.begin(), sorted.end(), [&](int a, int b) { return rank[size_t(a)] < rank[size_t(b)]; });
    JsonValue list = JsonValue::array();
    for (int d : sorted) list.push_back(JsonValue::string(ids[size_t(d)]));
    return list;
  };
  JsonValue ops = JsonValue::array();
  for (const auto& [name, op] : by_name) {
    JsonValue entry = JsonValue::object();
    for (const auto& [key, value] : op->entry.members())
      if (key != "variants") entry.set(key, value);
    int start = definition_at(defs, Place{op->place.file, op->definition_offset, 0, 0});
    if (start >= 0) entry.set("closure", closure_of(start));
    // Other entry functions of the op, each with its own closure.
    if (const JsonValue* variants = op->entry.find("variants")) {
      JsonValue list = JsonValue::array();
      for (const auto& v : variants->items()) {
        int found = -1;
        for (size_t d = 0; d < defs.size() && found < 0; ++d)
          if (!defs[d].macro && defs[d].name == v.as_string()) found = int(d);
        if (found < 0) {
          errors.at(files, op->place,
                    fmt::format("op '{}' names variant '{}', but no template defines a function of that name", name,
                                v.as_string()));
          continue;
        }
        JsonValue variant = JsonValue::object();
        variant.set("function", v);
        variant.set("closure", closure_of(found));
        list.push_back(std::move(variant));
      }
      entry.set("variants", std::move(list));
    }
    ops.push_back(std::move(entry));
  }
  if (errors.count()) return result;

  std::vector<std::string> file_texts;
  for (const auto& f : files) file_texts.push_back(read_file(f.path));
  JsonValue definitions = JsonValue::array();
  for (int i : order) {
    JsonValue d = JsonValue::object();
    const Definition& def = defs[size_t(i)];
    d.set("id", JsonValue::string(ids[size_t(i)]));
    d.set("file", JsonValue::string(files[size_t(def.file)].display));
    d.set("line", JsonValue::integer(def.line));
    d.set("text", JsonValue::string(definition_text(file_texts[size_t(def.file)], def)));
    definitions.push_back(std::move(d));
  }

  JsonValue root = JsonValue::object();
  root.set("format", JsonValue::string("cudagen.registry/1"));
  root.set("generated_by", JsonValue::string("cudagen-index"));
  root.set("ops", std::move(ops));
  root.set("definitions", std::move(definitions));
  result.registry_json = write_json(root);
  result.ops = int(by_name.size());
  result.definitions = int(defs.size());
  result.ok = true;
  return result;
}

}  // namespace cudagen
