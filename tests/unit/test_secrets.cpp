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
