#include <fmt/format.h>
#include <gtest/gtest.h>

#include "json.h"

using namespace cudagen;

TEST(Json, ParsesNestedValuesWithLocations) {
  JsonValue v = parse_json("{\n  \"a\": [1, 2.5, true, null],\n  \"b\": {\"c\": \"x\\u00e9\"}\n}");
  ASSERT_TRUE(v.is_object());
  const JsonValue* a = v.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->loc.line, 2);
  EXPECT_EQ(a->loc.column, 8);
  ASSERT_EQ(a->items().size(), 4u);
  EXPECT_TRUE(a->items()[0].is_int());
  EXPECT_EQ(a->items()[0].as_int(), 1);
  EXPECT_FALSE(a->items()[1].is_int());
  EXPECT_DOUBLE_EQ(a->items()[1].as_double(), 2.5);
  EXPECT_TRUE(a->items()[2].as_bool());
  EXPECT_TRUE(a->items()[3].is_null());
  EXPECT_EQ(v.find("b")->find("c")->as_string(), "x\xc3\xa9");
}

TEST(Json, SyntaxErrorsNameLineAndColumn) {
  try {
    parse_json("{\n  \"a\": 1,\n  \"b\" 2\n}");
    FAIL() << "expected a syntax error";
  } catch (const JsonSyntaxError& e) {
    EXPECT_EQ(e.loc.line, 3);
    EXPECT_EQ(e.loc.column, 7);
    EXPECT_NE(e.message.find("':'"), std::string::npos) << e.message;
  }
}

TEST(Json, RejectsDuplicateKeys) {
  try {
    parse_json("{\"a\": 1, \"a\": 2}");
    FAIL();
  } catch (const JsonSyntaxError& e) {
    EXPECT_NE(e.message.find("duplicate key \"a\""), std::string::npos);
    EXPECT_EQ(e.loc.column, 10);
  }
}

// Large objects check duplicates with a hash set once past a few keys: a
// duplicate is found wherever it is, and members keep their file order.
TEST(Json, FindsDuplicateKeysInLargeObjects) {
  for (int count : {15, 16, 17, 40000}) {
    std::string text = "{";
    for (int i = 0; i < count; ++i) text += fmt::format("\"k{}\": {}, ", i, i);
    JsonValue ok = parse_json(text + "\"last\": 0}");
    ASSERT_EQ(ok.members().size(), size_t(count) + 1);
    EXPECT_EQ(ok.members()[size_t(count) - 1].first, fmt::format("k{}", count - 1));
    EXPECT_EQ(ok.find("k0")->as_int(), 0);
    for (int again : {0, count / 2, count - 1}) {
      try {
        parse_json(text + fmt::format("\"k{}\": 1}}", again));
        ADD_FAILURE() << "no error for a duplicate k" << again << " in " << count << " keys";
      } catch (const JsonSyntaxError& e) {
        EXPECT_NE(e.message.find(fmt::format("duplicate key \"k{}\"", again)), std::string::npos) << e.message;
      }
    }
  }
}

TEST(Json, BoundsNestingDepth) {
  std::string deep(1000, '[');
  EXPECT_THROW(parse_json(deep), JsonSyntaxError);
}

TEST(Json, RejectsTrailingTextAndBadNumbers) {
  EXPECT_THROW(parse_json("{} x"), JsonSyntaxError);
  EXPECT_THROW(parse_json("01"), JsonSyntaxError);
  EXPECT_THROW(parse_json("1."), JsonSyntaxError);
  EXPECT_THROW(parse_json("1e999"), JsonSyntaxError);
  EXPECT_THROW(parse_json("\"\\ud800\""), JsonSyntaxError);
  EXPECT_THROW(parse_json("\"a\nb\""), JsonSyntaxError);
}

TEST(Json, DoublesKeepTheirFloatnessAndValue) {
  EXPECT_EQ(json_format_double(1.0), "1.0");
  EXPECT_EQ(json_format_double(0.1), "0.1");
  EXPECT_EQ(json_format_double(1e-8), "1e-08");
  for (double d : {0.1, 1.0 / 3, 6.02e23, -2.5e-300}) {
    JsonValue v = parse_json(json_format_double(d));
    EXPECT_FALSE(v.is_int());
    EXPECT_EQ(v.as_double(), d);
  }
}
