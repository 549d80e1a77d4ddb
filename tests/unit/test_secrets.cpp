#include <catch2/catch.hpp>

#include "util/secrets.hpp"

using lorarun::redact_uri;

TEST_CASE("redact_uri hides the password and keeps the rest") {
  CHECK(redact_uri("mongodb://alice:s3cr3t@db.example:27017/train?authSource=admin") ==
        "mongodb://alice:****@db.example:27017/train?authSource=admin");
  CHECK(redact_uri("mongodb+srv://bob:p%40ss@cluster0.example/") == "mongodb+srv://bob:****@cluster0.example/");
  // '@' inside the password: the last '@' before the path ends the userinfo.
  CHECK(redact_uri("mongodb://carol:a@b@host/") == "mongodb://carol:****@host/");
  CHECK(redact_uri("mongodb://host1,host2/?replicaSet=rs") == "mongodb://host1,host2/?replicaSet=rs");
  CHECK(redact_uri("mongodb://dave@host/") == "mongodb://dave@host/");
  CHECK(redact_uri("not a uri") == "not a uri");
  // An '@' in the query string is not userinfo.
  CHECK(redact_uri("mongodb://host/?appname=a@b") == "mongodb://host/?appname=a@b");
}

TEST_CASE("scrub removes registered passwords, raw and percent-decoded") {
  lorarun::register_uri_secret("mongodb://erin:pa%24%24word@h/");
  CHECK(lorarun::scrub("auth failed for pa%24%24word") == "auth failed for ****");
  CHECK(lorarun::scrub("auth failed for pa$$word!") == "auth failed for ****!");
  CHECK(lorarun::scrub("nothing here") == "nothing here");
}

TEST_CASE("a password holding '#', '?', '/', '@' or ':' is hidden whole, wherever it stands") {
  for (const std::string pw : {"p#ss", "p?ss", "p/ss", "p@ss", "a@b@c", "x/y?z#w@v", "#?/", "ends@", "p:ss"}) {
    INFO(pw);
    const std::string shown = redact_uri("mongodb://frank:" + pw + "@db.example:27017/train?authSource=admin");
    CHECK(shown == "mongodb://frank:****@db.example:27017/train?authSource=admin");
    CHECK(lorarun::uri_password("mongodb://frank:" + pw + "@h/") == pw);
  }
  // Options holding an '@' after a password: more is hidden, never less.
  const std::string shown = redact_uri("mongodb://gina:s3/cr@t@h/db?appname=a@b");
  CHECK(shown.find("s3") == std::string::npos);
  CHECK(shown.find("cr") == std::string::npos);
  CHECK(shown.find("t@h") == std::string::npos);
}

TEST_CASE("scrub hides the longest registered secret first") {
  lorarun::register_secret("abc");
  lorarun::register_secret("xxabcxx");
  CHECK(lorarun::scrub("[xxabcxx] [abc]") == "[****] [****]");
}
