#include <map>

#include <gtest/gtest.h>

#include "shape_rule.h"

using namespace cudagen;

namespace {

std::vector<ShapeMismatch> check(const std::string& rule, const std::map<std::string, Shape>& shapes,
                                 const std::map<std::string, int64_t>& args = {}) {
  ShapeRule r = parse_shape_rule(rule);
  ShapeEnv env;
  env.shape_of = [&](std::string_view s) -> const Shape* {
    auto it = shapes.find(std::string(s));
    return it == shapes.end() ? nullptr : &it->second;
  };
  env.is_arg = [&](std::string_view a) { return args.count(std::string(a)) > 0; };
  env.arg_of = [&](std::string_view a) -> std::optional<int64_t> {
    auto it = args.find(std::string(a));
    return it == args.end() ? std::nullopt : std::optional<int64_t>(it->second);
  };
  return check_shape_rule(r, env);
}

}  // namespace

TEST(ShapeRule, ParsesEveryForm) {
  ShapeRule r = parse_shape_rule("a:[...A, t ? K : M, 2*(N+1)] b:[] -> out:[...broadcast(A, B), M]; numel(a) == numel(out)");
  ASSERT_EQ(r.inputs.size(), 2u);
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_EQ(r.inputs[0].text, "a:[...A, t ? K : M, 2*(N+1)]");
  EXPECT_EQ(r.inputs[0].dims[1].expr.str(), "t ? K : M");
  EXPECT_EQ(r.inputs[0].dims[2].expr.str(), "2*(N + 1)");
  EXPECT_EQ(r.outputs[0].dims[0].kind, DimItem::Kind::BroadcastPack);
  ASSERT_EQ(r.same_numel.size(), 1u);
}

TEST(ShapeRule, SyntaxErrorsNameTheColumn) {
  try {
    parse_shape_rule("a:[M, K b:[K] -> out:[M]");
    FAIL();
  } catch (const ShapeRuleSyntaxError& e) {
    EXPECT_STREQ(e.what(), "shape rule \"a:[M, K b:[K] -> out:[M]\", column 9: expected ',' or ']'");
  }
  EXPECT_THROW(parse_shape_rule("a:[...A, ...B] -> out:[]"), ShapeRuleSyntaxError);
  EXPECT_THROW(parse_shape_rule("a:[M]"), ShapeRuleSyntaxError);
}

TEST(ShapeRule, MatmulBindsAndChecks) {
  const char* rule = "a:[M, K] b:[K, N] -> out:[M, N]";
  EXPECT_TRUE(check(rule, {{"a", {2, 3}}, {"b", {3, 4}}, {"out", {2, 4}}}).empty());
  auto errors = check(rule, {{"a", {2, 3}}, {"b", {5, 4}}, {"out", {2, 4}}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].slot, "b");
  EXPECT_EQ(errors[0].message, "b[0] is 5, but it must equal K = 3 (from a[1]) (op shape rule: " + std::string(rule) + ")");
  errors = check(rule, {{"a", {2, 3, 1}}, {"b", {3, 4}}, {"out", {2, 4}}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("a has shape [2, 3, 1] (rank 3), but the op wants rank 2"), std::string::npos);
}

TEST(ShapeRule, ExpressionsAndArguments) {
  const char* rule = "x:[B, T, heads*D] -> out:[B, heads, T, D]";
  EXPECT_TRUE(check(rule, {{"x", {2, 5, 12}}, {"out", {2, 3, 5, 4}}}, {{"heads", 3}}).empty());
  auto errors = check(rule, {{"x", {2, 5, 12}}, {"out", {2, 4, 5, 3}}}, {{"heads", 3}});
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].message.find("x[2] is 12, but it must equal heads*D = 9"), std::string::npos) << errors[0].message;
  EXPECT_NE(errors[1].message.find("out[1] is 4, but it must equal heads = 3"), std::string::npos) << errors[1].message;
}

TEST(ShapeRule, PacksMustAgree) {
  const char* rule = "a:[...S, N] b:[...S, N] -> out:[...S]";
  EXPECT_TRUE(check(rule, {{"a", {2, 3, 4}}, {"b", {2, 3, 4}}, {"out", {2, 3}}}).empty());
  auto errors = check(rule, {{"a", {2, 3, 4}}, {"b", {3, 3, 4}}, {"out", {2, 3}}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("b[0:2] is [3, 3], but it must equal [2, 3] (from a[0:2])"), std::string::npos);
}

TEST(ShapeRule, ScalarsAndNumel) {
  EXPECT_TRUE(check("p:[...S] -> loss:[]", {{"p", {4}}, {"loss", {}}}).empty());
  EXPECT_FALSE(check("p:[...S] -> loss:[]", {{"p", {4}}, {"loss", {1}}}).empty());
  const char* reshape = "x:[...S] -> out:[...R]; numel(x) == numel(out)";
  EXPECT_TRUE(check(reshape, {{"x", {4, 6}}, {"out", {2, 12}}}).empty());
  auto errors = check(reshape, {{"x", {4, 6}}, {"out", {5, 5}}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("out [5, 5] has 25 elements, but x [4, 6] has 24"), std::string::npos);
}

TEST(ShapeRule, AbsentOptionalSlotIsSkipped) {
  EXPECT_TRUE(check("x:[...S, N] -> out:[...S, N] rstd:[...S]", {{"x", {3, 4}}, {"out", {3, 4}}}).empty());
}

// '-' and '/' (rounding down): a convolution's output size.
TEST(ShapeRule, SubtractionAndFloorDivisionGiveAConvolutionsOutputSize) {
  const char* rule = "x:[H] w:[K] -> out:[(H + 2 * p - d * (K - 1) - 1) / s + 1]";
  ShapeRule r = parse_shape_rule(rule);
  EXPECT_EQ(r.outputs[0].dims[0].expr.str(), "(H + 2*p - d*(K - 1) - 1) / s + 1");
  const std::map<std::string, int64_t> args = {{"p", 1}, {"d", 1}, {"s", 2}};
  EXPECT_TRUE(check(rule, {{"x", {10}}, {"w", {3}}, {"out", {5}}}, args).empty());   // (10 + 2 - 2 - 1) / 2 + 1
  EXPECT_TRUE(check(rule, {{"x", {9}}, {"w", {3}}, {"out", {5}}}, args).empty());    // 8 / 2 + 1
  auto errors = check(rule, {{"x", {10}}, {"w", {3}}, {"out", {6}}}, args);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("out[0] is 6, but it must equal (H + 2*p - d*(K - 1) - 1) / s + 1 = 5"),
            std::string::npos)
      << errors[0].message;
  // A kernel wider than the padded input: (2 - 4 - 1) / 2 rounds down to -2, so no shape fits.
  errors = check(rule, {{"x", {2}}, {"w", {5}}, {"out", {1}}}, {{"p", 0}, {"d", 1}, {"s", 2}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("= -1"), std::string::npos) << errors[0].message;
  errors = check(rule, {{"x", {10}}, {"w", {3}}, {"out", {5}}}, {{"p", 1}, {"d", 1}, {"s", 0}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("divides by zero (s is 0)"), std::string::npos) << errors[0].message;
  // '-' next to '->' is still the arrow.
  EXPECT_EQ(parse_shape_rule("a:[N-1]->b:[N]").inputs[0].dims[0].expr.str(), "N - 1");
  EXPECT_EQ(parse_shape_rule("a:[N] -> b:[N / (2*M)] c:[M]").outputs[0].dims[0].expr.str(), "N / (2*M)");
}

// Hostile rules (issue #34): INT64_MIN / -1 killed cudagen with SIGFPE, and
// 10,000 nested parentheses overflowed the stack.
TEST(ShapeRule, HostileFormulasGiveErrorsNotCrashes) {
  auto errors = check("x:[N] -> out:[(0 - 4611686018427387904 - 4611686018427387904) / (0 - 1)]", {{"x", {1}}, {"out", {1}}});
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].message.find("overflows 64 bits"), std::string::npos) << errors[0].message;

  const std::string deep = "x:[" + std::string(10000, '(') + "N" + std::string(10000, ')') + "] -> out:[N]";
  try {
    parse_shape_rule(deep);
    FAIL() << "a rule nested 10,000 deep parsed";
  } catch (const ShapeRuleSyntaxError& e) {
    EXPECT_NE(std::string(e.what()).find("the formula nests more than 64 levels deep"), std::string::npos) << e.what();
  }
  std::string long_sum = "N";
  for (int i = 0; i < 5000; ++i) long_sum += " + N";
  EXPECT_THROW(parse_shape_rule("x:[" + long_sum + "] -> out:[N]"), ShapeRuleSyntaxError);
  // Within the bounds: 60 levels and 4,000 terms still parse.
  EXPECT_NO_THROW(parse_shape_rule("x:[" + std::string(60, '(') + "N" + std::string(60, ')') + "] -> out:[N]"));
  std::string sum = "N";
  for (int i = 0; i < 4000; ++i) sum += "+N";
  EXPECT_NO_THROW(parse_shape_rule("x:[" + sum + "] -> out:[N]"));
}
