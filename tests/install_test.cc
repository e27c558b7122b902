// gradsync as another project sees it: `cmake --install` into a temporary prefix gives the
// public headers, a versioned shared library (SONAME libgradsync.so.MAJOR) and the static one,
// the tools, a CMake package and a pkg-config file; examples/downstream builds against it both
// ways (find_package, and make with pkg-config) and its 2-rank all-reduce runs correctly under
// the installed gradsync-run; every installed tool reports the one version; `make deb`'s
// package holds the same under /usr with its dependencies.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "gradsync/gradsync.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;
using testing::run_shell;

class Install : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
#ifdef GRADSYNC_TEST_SANITIZED
    GTEST_SKIP() << "a sanitized library needs its runtime loaded first in every program";
#endif
    tmp_ = new testing::TempDir;
    prefix_ = tmp_->path() + "/prefix";
    install_ =
        run_shell("cmake --install " + testing::build_dir() + " --prefix " + prefix_ + " 2>&1");
  }
  static void TearDownTestSuite() {
    delete tmp_;
    tmp_ = nullptr;
  }
  void SetUp() override {
#ifdef GRADSYNC_TEST_SANITIZED
    GTEST_SKIP() << "a sanitized library needs its runtime loaded first in every program";
#endif
    ASSERT_EQ(install_.exit_code(), 0) << install_.output;
  }

  static std::string run_two_ranks(const std::string& program) {
    const auto r = run_shell(prefix_ + "/bin/gradsync-run -n 2 -- " + program + " 2>&1");
    EXPECT_EQ(r.exit_code(), 0) << r.output;
    return r.output;
  }

  static testing::TempDir* tmp_;
  static std::string prefix_;
  static testing::ShellResult install_;
};

testing::TempDir* Install::tmp_ = nullptr;
std::string Install::prefix_;
testing::ShellResult Install::install_;

TEST_F(Install, LaysOutHeadersLibrariesToolsAndPackageFiles) {
  namespace fs = std::filesystem;
  for (const auto& header : fs::directory_iterator(testing::source_dir() + "/include/gradsync")) {
    if (header.path().extension() != ".h") continue;
    EXPECT_TRUE(fs::exists(prefix_ + "/include/gradsync/" + header.path().filename().string()))
        << header.path();
  }
  EXPECT_TRUE(fs::exists(prefix_ + "/include/gradsync/version.h"));
  std::string libdir;
  for (const std::string candidate : {"/lib", "/lib/x86_64-linux-gnu", "/lib64"}) {
    if (fs::exists(prefix_ + candidate + "/libgradsync.so")) libdir = prefix_ + candidate;
  }
  ASSERT_FALSE(libdir.empty()) << install_.output;
  EXPECT_TRUE(fs::exists(libdir + "/libgradsync.a"));
  EXPECT_TRUE(fs::exists(libdir + "/libgradsync.so." + std::string(GRADSYNC_VERSION_STRING)));
  const auto soname = run_shell("readelf -d " + libdir + "/libgradsync.so 2>&1");
  EXPECT_TRUE(
      contains(soname.output, "[libgradsync.so." + std::to_string(GRADSYNC_VERSION_MAJOR) + "]"))
      << soname.output;
  EXPECT_TRUE(fs::exists(libdir + "/cmake/gradsync/gradsyncConfig.cmake"));
  EXPECT_TRUE(fs::exists(libdir + "/cmake/gradsync/gradsyncConfigVersion.cmake"));
  const std::string pkg_config = "PKG_CONFIG_PATH=" + libdir + "/pkgconfig pkg-config ";
  const auto modversion = run_shell(pkg_config + "--modversion gradsync 2>&1");
  EXPECT_EQ(modversion.output, std::string(GRADSYNC_VERSION_STRING) + "\n");
  const auto libs = run_shell(pkg_config + "--libs gradsync 2>&1");
  EXPECT_TRUE(contains(libs.output, "-lgradsync")) << libs.output;
  for (const std::string tool :
       {"gradsync-run", "gradsync-bench", "gradsync-advise", "gradsync-train", "gradsync-probe"}) {
    const auto r = run_shell(prefix_ + "/bin/" + tool + " --version 2>&1");
    EXPECT_EQ(r.exit_code(), 0) << tool << ": " << r.output;
    EXPECT_EQ(r.output, tool + " " + version() + "\n");
  }
  EXPECT_EQ(std::string(version()), GRADSYNC_VERSION_STRING);
}

TEST_F(Install, ADownstreamCMakeProjectFindsAndLinksIt) {
  const std::string build = tmp_->path() + "/cmake-build";
  const auto configure =
      run_shell("cmake -S " + testing::source_dir() + "/examples/downstream -B " + build +
                " -G Ninja " + "-DCMAKE_PREFIX_PATH=" + prefix_ + " 2>&1");
  ASSERT_EQ(configure.exit_code(), 0) << configure.output;
  const auto compile = run_shell("cmake --build " + build + " 2>&1");
  ASSERT_EQ(compile.exit_code(), 0) << compile.output;
  const std::string out = run_two_ranks(build + "/allreduce_check");
  EXPECT_EQ(testing::count_of(out, "all-reduce correct, gradsync " + std::string(version())), 2)
      << out;
  const std::string c_out = run_two_ranks(build + "/allreduce_check_c");
  EXPECT_EQ(testing::count_of(c_out, "C all-reduce correct, gradsync " + std::string(version())), 2)
      << c_out;
}

TEST_F(Install, ADownstreamMakefileLinksItThroughPkgConfig) {
  namespace fs = std::filesystem;
  std::string libdir = prefix_ + "/lib";
  if (!fs::exists(libdir + "/pkgconfig/gradsync.pc")) libdir = prefix_ + "/lib/x86_64-linux-gnu";
  const std::string out_dir = tmp_->path() + "/make-build";
  fs::create_directories(out_dir);
  const auto compile =
      run_shell("PKG_CONFIG_PATH=" + libdir + "/pkgconfig make -C " + testing::source_dir() +
                "/examples/downstream OUT=" + out_dir + " 2>&1");
  ASSERT_EQ(compile.exit_code(), 0) << compile.output;
  const std::string out = run_two_ranks(out_dir + "/allreduce_check");
  EXPECT_EQ(testing::count_of(out, "all-reduce correct"), 2) << out;
  const std::string c_out = run_two_ranks(out_dir + "/allreduce_check_c");
  EXPECT_EQ(testing::count_of(c_out, "C all-reduce correct"), 2) << c_out;
}

// make deb's package (cpack over the same install rules, for /usr): the library with its
// SONAME link, headers, tools and the Python package where Debian's python3 looks, and the
// dependencies dpkg-shlibdeps found.
TEST_F(Install, TheDebianPackageHoldsTheInstallUnderUsr) {
  const std::string out = tmp_->path() + "/deb";
  const auto pack =
      run_shell("cd " + testing::build_dir() + " && cpack -G DEB -B " + out + " 2>&1");
  ASSERT_EQ(pack.exit_code(), 0) << pack.output;
  const std::string deb = out + "/gradsync_" + std::string(version()) + "_amd64.deb";
  const auto contents = run_shell("dpkg-deb -c " + deb + " 2>&1");
  ASSERT_EQ(contents.exit_code(), 0) << contents.output;
  for (const std::string& path :
       {"./usr/lib/libgradsync.so.0 -> libgradsync.so." + std::string(version()),
        std::string("./usr/include/gradsync/gradsync.h"),
        std::string("./usr/include/gradsync/version.h"), std::string("./usr/bin/gradsync-run"),
        std::string("./usr/bin/gradsync-train"),
        std::string("./usr/lib/cmake/gradsync/gradsyncConfig.cmake"),
        std::string("./usr/lib/pkgconfig/gradsync.pc"),
        std::string("./usr/lib/python3.11/dist-packages/gradsync/__init__.py")}) {
    EXPECT_TRUE(contains(contents.output, path)) << path << "\n" << contents.output;
  }
  const auto fields = run_shell("dpkg-deb -f " + deb + " Package Version Depends Suggests 2>&1");
  EXPECT_TRUE(contains(fields.output, "Version: " + std::string(version()))) << fields.output;
  // libssl3: the handshakes' HMAC (libcrypto).
  for (const char* dependency : {"libc6", "libstdc++6", "libssl3", "python3-numpy"}) {
    EXPECT_TRUE(contains(fields.output, dependency)) << fields.output;
  }
  // libucx0: suggested where the build has the ucx transport, never required (the library
  // loads UCX only for a job that uses it).
  EXPECT_FALSE(contains(fields.output.substr(0, fields.output.find("Suggests:")), "libucx0"))
      << fields.output;
  EXPECT_EQ(contains(fields.output, "Suggests: libucx0"), GRADSYNC_HAVE_UCX == 1) << fields.output;
  // The torch backend imports torch's Python package, which no shared library names.
  if (contains(contents.output, "/gradsync/torch/_backend")) {
    EXPECT_TRUE(contains(fields.output, "python3-torch")) << fields.output;
  }
}

}  // namespace
}  // namespace gradsync
