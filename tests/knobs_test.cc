// The knob registry (core/knobs.h) against what it describes: README's knob table lists
// exactly its variables with its defaults, no source file names a variable it lacks or reads
// one around it, and the defaults it states are the code's. Then, for a representative set of
// knobs: an explicit Options field beats the environment, which beats the default; garbage
// is refused naming the variable; init() and the transports use what was resolved.
#include "core/knobs.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string_view>

#include "core/env.h"
#include "harness.h"
#include "transport/shm_group.h"
#include "transport/tcp_tuning.h"

namespace gradsync {
namespace {

using testing::contains;

// Sets variables for one test; every per-context knob and launcher variable is unset before
// and after.
class KnobEnv {
 public:
  explicit KnobEnv(std::initializer_list<std::pair<const char*, const char*>> vars = {}) {
    clear();
    for (auto [k, v] : vars) ::setenv(k, v, 1);
  }
  ~KnobEnv() { clear(); }
  KnobEnv(const KnobEnv&) = delete;
  KnobEnv& operator=(const KnobEnv&) = delete;

 private:
  static void clear() {
    for (const knobs::Knob& k : knobs::all()) {
      if (k.scope != knobs::Scope::kProcess) ::unsetenv(std::string(k.name).c_str());
    }
  }
};

bool registered(const std::string& name) {
  for (const knobs::Knob& k : knobs::all()) {
    if (k.name == name) return true;
  }
  return false;
}

// The cells of a markdown table row, trimmed, without the backticks that style them.
std::vector<std::string> cells(const std::string& row) {
  std::vector<std::string> out;
  std::stringstream in(row.substr(1));
  std::string cell;
  while (std::getline(in, cell, '|')) {
    std::erase(cell, '`');
    const auto first = cell.find_first_not_of(' '), last = cell.find_last_not_of(' ');
    out.push_back(first == std::string::npos ? "" : cell.substr(first, last - first + 1));
  }
  return out;
}

// A row as README should have it, for the failure message.
std::string readme_row(const knobs::Knob& k) {
  const std::string setter =
      k.setter.starts_with("Options::") ? "`" + std::string(k.setter) + "`" : std::string(k.setter);
  return "| `" + std::string(k.name) + "` | " + setter + " | " + std::string(k.default_text) +
         " | " + std::string(k.accepts) + " | " + std::string(k.meaning) + " |";
}

// The C API's constants (gradsync_c.h's enumerators and macros, its include guard): names
// with the prefix that are no variables either. Parsed by hand, not with std::regex: GCC 12
// warns about its own regex code under the sanitizer builds' -O2 -Werror.
const std::set<std::string>& c_api_names() {
  static const std::set<std::string> names = [] {
    std::set<std::string> found;
    std::stringstream lines(
        testing::read_file(testing::source_dir() + "/include/gradsync/gradsync_c.h"));
    for (std::string line; std::getline(lines, line);) {
      std::string_view rest(line);
      rest.remove_prefix(std::min(rest.size(), rest.find_first_not_of(" \t")));
      for (const std::string_view directive : {"#define ", "#ifndef "}) {
        if (rest.starts_with(directive)) rest.remove_prefix(directive.size());
      }
      if (!rest.starts_with("GRADSYNC_")) continue;
      std::size_t end = 0;
      while (end < rest.size() &&
             (std::isupper(static_cast<unsigned char>(rest[end])) ||
              std::isdigit(static_cast<unsigned char>(rest[end])) || rest[end] == '_')) {
        ++end;
      }
      found.emplace(rest.substr(0, end));
    }
    return found;
  }();
  return names;
}

std::vector<std::string> variables_in(const std::string& text) {
  const std::string prefix = "GRADSYNC_";
  std::vector<std::string> found;
  for (std::size_t at = text.find(prefix); at != std::string::npos;
       at = text.find(prefix, at + 1)) {
    std::size_t end = at + prefix.size();
    while (end < text.size() &&
           (std::isupper(static_cast<unsigned char>(text[end])) ||
            std::isdigit(static_cast<unsigned char>(text[end])) || text[end] == '_')) {
      ++end;
    }
    const std::string name = text.substr(at, end - at);
    // version.h's macros (GRADSYNC_VERSION_MAJOR, ...), the build's options
    // (GRADSYNC_WITH_UCX) and what they define (GRADSYNC_HAVE_UCX) share the prefix but are
    // no variables.
    if (end > at + prefix.size() && !name.starts_with("GRADSYNC_VERSION_") &&
        !name.starts_with("GRADSYNC_WITH_") && !name.starts_with("GRADSYNC_HAVE_") &&
        !c_api_names().contains(name)) {
      found.push_back(name);
    }
  }
  return found;
}

// True if `line` calls getenv or get on a "GRADSYNC_..." literal: a read around the registry.
bool reads_a_variable_directly(const std::string& line) {
  for (std::size_t at = line.find("\"GRADSYNC_"); at != std::string::npos;
       at = line.find("\"GRADSYNC_", at + 1)) {
    std::size_t i = at;
    while (i > 0 && std::isspace(static_cast<unsigned char>(line[i - 1]))) --i;
    if (i == 0 || line[i - 1] != '(') continue;
    --i;
    while (i > 0 && std::isspace(static_cast<unsigned char>(line[i - 1]))) --i;
    std::size_t start = i;
    while (start > 0 &&
           (std::isalnum(static_cast<unsigned char>(line[start - 1])) || line[start - 1] == '_')) {
      --start;
    }
    const std::string callee = line.substr(start, i - start);
    if (callee == "getenv" || callee == "get") return true;
  }
  return false;
}

TEST(Knobs, RowsAreSortedAndComplete) {
  std::string previous;
  for (const knobs::Knob& k : knobs::all()) {
    const std::string name(k.name);
    EXPECT_LT(previous, name) << "rows out of order";
    previous = name;
    EXPECT_EQ(name.starts_with("GRADSYNC_"), k.scope != knobs::Scope::kLauncher) << name;
    for (std::string_view field : {k.default_text, k.accepts, k.setter, k.meaning}) {
      EXPECT_FALSE(field.empty()) << name;
      EXPECT_EQ(field.find('|'), std::string_view::npos) << name << ": breaks README's table";
    }
    // An integer's row states its range, which is what a refusal quotes: the static one, or,
    // for a rank, the size it must stay below (checked once the size is known).
    if (k.max > k.min) {
      const std::string range = "[" + std::to_string(k.min) + ", " + std::to_string(k.max) + "]";
      const std::string accepts(k.accepts);
      const bool is_a_rank = k.max == knobs::kMaxWorldSize - 1 && contains(accepts, "SIZE)");
      EXPECT_TRUE(contains(accepts, "an integer in " + range) || is_a_rank) << name;
    } else {
      EXPECT_FALSE(contains(std::string(k.accepts), "integer"))
          << name << ": an integer row needs its range";
    }
    if (k.scope == knobs::Scope::kLauncher) {
      EXPECT_FALSE(k.logged) << name << ": every rank of every job sets it";
    }
    if (k.scope != knobs::Scope::kProcess) {
      EXPECT_TRUE(k.setter.starts_with("Options::")) << name << ": per context, so a field";
    } else {
      EXPECT_TRUE(k.setter.starts_with("none: ")) << name << ": says why there is no field";
    }
  }
}

TEST(Knobs, UnregisteredNameIsALogicError) {
  EXPECT_THROW(knobs::find("GRADSYNC_NO_SUCH_KNOB"), std::logic_error);
  EXPECT_THROW(knobs::text("GRADSYNC_NO_SUCH_KNOB"), std::logic_error);
  EXPECT_THROW(knobs::integer("GRADSYNC_NO_SUCH_KNOB"), std::logic_error);
  EXPECT_THROW(knobs::integer("GRADSYNC_ALGO"), std::logic_error) << "a text knob";
  // Another library's variables are read apart, never gradsync's own through that door.
  EXPECT_THROW(knobs::foreign_text("GRADSYNC_ALGO"), std::logic_error);
  EXPECT_THROW(knobs::foreign_text("GRADSYNC_NO_SUCH_KNOB"), std::logic_error);
  EXPECT_THROW(knobs::foreign_text("WORLD_SIZE"), std::logic_error) << "a launcher variable";
  ::setenv("UCX_GRADSYNC_KNOBS_TEST", "tcp", 1);
  EXPECT_EQ(knobs::foreign_text("UCX_GRADSYNC_KNOBS_TEST"), "tcp");
  ::unsetenv("UCX_GRADSYNC_KNOBS_TEST");
  EXPECT_EQ(knobs::foreign_text("UCX_GRADSYNC_KNOBS_TEST"), std::nullopt);
}

// README's tables (variable, Options field, default, accepts, meaning) have one row per knob
// and launcher variable, with the registry's field, default and accepted values; the meaning
// may be worded freely.
TEST(Knobs, ReadmeTableListsExactlyTheRegistry) {
  const std::string readme = testing::read_file(testing::source_dir() + "/README.md");
  ASSERT_FALSE(readme.empty());
  std::map<std::string, std::vector<std::string>> rows;
  std::stringstream lines(readme);
  for (std::string line; std::getline(lines, line);) {
    // A row whose first cell is a variable's name: `UPPER_CASE`.
    const std::size_t close = line.find('`', 3);
    if (line.starts_with("| `") && close != std::string::npos && close > 3 &&
        std::all_of(line.begin() + 3, line.begin() + static_cast<std::ptrdiff_t>(close),
                    [](char c) {
                      return std::isupper(static_cast<unsigned char>(c)) ||
                             std::isdigit(static_cast<unsigned char>(c)) || c == '_';
                    })) {
      auto c = cells(line);
      rows[c[0]] = c;
    }
  }
  for (const knobs::Knob& k : knobs::all()) {
    const std::string name(k.name);
    auto it = rows.find(name);
    if (it == rows.end()) {
      ADD_FAILURE() << "README lacks " << name << "; add\n" << readme_row(k);
      continue;
    }
    const auto& c = it->second;
    ASSERT_GE(c.size(), 5u) << name;
    EXPECT_EQ(c[1], k.setter) << "README's row should be\n" << readme_row(k);
    EXPECT_EQ(c[2], k.default_text) << "README's row should be\n" << readme_row(k);
    EXPECT_EQ(c[3], k.accepts) << "README's row should be\n" << readme_row(k);
  }
  for (const auto& [name, row] : rows) {
    EXPECT_TRUE(registered(name)) << "README lists " << name << ", which is no knob";
  }
  // Nor does the prose name a variable that is gone.
  for (const std::string& name : variables_in(readme)) {
    EXPECT_TRUE(registered(name)) << "README names " << name << ", which is no knob";
  }
}

// Every GRADSYNC_* name in the library's sources and headers is a registered knob, and only
// the registry reads the environment (env.cc reads the launchers' variables, none of ours).
TEST(Knobs, SourcesNameAndReadVariablesOnlyThroughTheRegistry) {
  // The scanners themselves, on lines they must and must not flag.
  EXPECT_TRUE(reads_a_variable_directly(R"(const char* v = std::getenv( "GRADSYNC_TOKEN");)"));
  EXPECT_TRUE(reads_a_variable_directly(R"(auto v = env::get("GRADSYNC_ALGO");)"));
  EXPECT_FALSE(reads_a_variable_directly(R"(knobs::text("GRADSYNC_ALGO");)"));
  EXPECT_EQ(variables_in("GRADSYNC_TCP_SPIN_US=1 and GRADSYNC_ALGO, not GRADSYNC_VERSION_MAJOR."),
            (std::vector<std::string>{"GRADSYNC_TCP_SPIN_US", "GRADSYNC_ALGO"}));
  namespace fs = std::filesystem;
  int files = 0;
  for (const char* dir : {"src", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(testing::source_dir() + "/" + dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".h" && ext != ".cc")) continue;
      ++files;
      const std::string path = entry.path().string();
      const std::string relative = path.substr(testing::source_dir().size() + 1);
      const std::string text = testing::read_file(path);
      std::stringstream lines(text);
      int number = 0;
      for (std::string line; std::getline(lines, line);) {
        ++number;
        const std::string where = relative + ":" + std::to_string(number);
        for (const std::string& name : variables_in(line)) {
          EXPECT_TRUE(registered(name))
              << where << " names " << name << ", which src/core/knobs.cc does not register";
        }
        EXPECT_FALSE(reads_a_variable_directly(line))
            << where << " reads a variable around the registry: " << line;
      }
      if (relative != "src/core/knobs.cc" && relative != "src/core/env.cc") {
        EXPECT_FALSE(contains(text, "getenv")) << relative << " reads the environment itself";
      }
    }
  }
  EXPECT_GT(files, 50) << "scanned " << testing::source_dir();
}

// The defaults the registry states are those the code applies.
TEST(Knobs, StatedDefaultsAreTheCodes) {
  auto stated = [](const char* name) { return std::string(knobs::find(name).default_text); };
  EXPECT_EQ(stated("GRADSYNC_TIMEOUT"), std::to_string(env::kDefaultTimeout.count()));
  EXPECT_EQ(stated("GRADSYNC_TCP_LIVENESS_S"), std::to_string(transport::TcpOptions{}.liveness_s));
  EXPECT_EQ(stated("GRADSYNC_TCP_SOCKBUF_BYTES"),
            std::to_string(transport::TcpOptions{}.socket_buffer_bytes));
  const std::string yielding = " yielding when ranks share cores";
  EXPECT_EQ(stated("GRADSYNC_TCP_SPIN_US"),
            std::to_string(transport::tcp::kBusySpin.count()) + ", or " +
                std::to_string(transport::tcp::kYieldSpin.count()) + yielding);
  using namespace transport::shm;
  EXPECT_EQ(stated("GRADSYNC_SHM_SPIN_US"), std::to_string(kSpinBeforeSleep.count()) + ", or " +
                                                std::to_string(kOversubscribedMessageSpin.count()) +
                                                yielding);
  EXPECT_EQ(kOversubscribedArenaSpin, kOversubscribedMessageSpin) << "one number in the row";
  EXPECT_EQ(stated("GRADSYNC_ALGO"), "auto");
  EXPECT_EQ(Options{}.algorithm, Algorithm::kAuto);

  KnobEnv none;
  Options o = env::resolve({});
  EXPECT_EQ(o.timeout, env::kDefaultTimeout);
  EXPECT_TRUE(o.topology.empty() && o.cost_model.empty() && o.transport.empty());
  EXPECT_TRUE(o.host_id.empty() && o.socket_ifname.empty() && o.socket_addr.empty());
  // Unset stays unset: the transports apply their own defaults (checked above).
  EXPECT_EQ(o.tcp_liveness_s, -1);
  EXPECT_EQ(o.tcp_socket_buffer_bytes, -1);
  EXPECT_EQ(o.tcp_spin_us, -1);
  EXPECT_EQ(o.shm_spin_us, -1);
}

TEST(Knobs, ExplicitFieldBeatsEnvironmentBeatsDefault) {
  // Count knobs (one per transport's tuning): 0 is a value ("off", "at once"), not unset.
  for (auto [name, field] :
       {std::pair{"GRADSYNC_TCP_SPIN_US", &Options::tcp_spin_us},
        std::pair{"GRADSYNC_TCP_LIVENESS_S", &Options::tcp_liveness_s},
        std::pair{"GRADSYNC_TCP_SOCKBUF_BYTES", &Options::tcp_socket_buffer_bytes},
        std::pair{"GRADSYNC_SHM_SPIN_US", &Options::shm_spin_us}}) {
    SCOPED_TRACE(name);
    KnobEnv env({{name, "7"}});
    EXPECT_EQ(env::resolve({}).*field, 7);
    Options explicit_options;
    explicit_options.*field = 0;
    EXPECT_EQ(env::resolve(explicit_options).*field, 0);
  }
  // Text knobs.
  for (auto [name, field] : {std::pair{"GRADSYNC_TOPOLOGY", &Options::topology},
                             std::pair{"GRADSYNC_COST_MODEL", &Options::cost_model},
                             std::pair{"GRADSYNC_HOST_ID", &Options::host_id},
                             std::pair{"GRADSYNC_SOCKET_IFNAME", &Options::socket_ifname},
                             std::pair{"GRADSYNC_SOCKET_ADDR", &Options::socket_addr},
                             std::pair{"GRADSYNC_TOKEN", &Options::token},
                             std::pair{"GRADSYNC_TRANSPORT", &Options::transport}}) {
    SCOPED_TRACE(name);
    const bool is_topology = std::string(name) == "GRADSYNC_TOPOLOGY";
    const bool is_cost = std::string(name) == "GRADSYNC_COST_MODEL";
    const bool is_transport = std::string(name) == "GRADSYNC_TRANSPORT";
    const char* from_env = is_topology ? "0,2;1,3" : is_cost ? "alpha_us=500" : "tcp";
    const char* given = is_topology ? "0,1;2,3" : is_cost ? "alpha_us=2" : "shm";
    if (!is_topology && !is_cost && !is_transport) from_env = "from-env", given = "given";
    KnobEnv env({{name, from_env}});
    EXPECT_EQ(env::resolve({}).*field, from_env);
    Options explicit_options;
    explicit_options.*field = given;
    EXPECT_EQ(env::resolve(explicit_options).*field, given);
  }
  // The timeout.
  KnobEnv env({{"GRADSYNC_TIMEOUT", "1500"}});
  EXPECT_EQ(env::resolve({}).timeout.count(), 1500);
  Options explicit_options;
  explicit_options.timeout = std::chrono::milliseconds(20);
  EXPECT_EQ(env::resolve(explicit_options).timeout.count(), 20);
}

Error refused_by_resolve(std::initializer_list<std::pair<const char*, const char*>> vars,
                         const Options& options = {}) {
  KnobEnv env(vars);
  return testing::expect_error(ErrorKind::kInvalidArgument, [&] { env::resolve(options); });
}

TEST(Knobs, GarbageIsRefusedNamingTheVariableAndWhatItAccepts) {
  const std::pair<const char*, const char*> garbage[] = {
      {"GRADSYNC_TCP_SPIN_US", "fast"},
      {"GRADSYNC_TCP_LIVENESS_S", "-1"},
      {"GRADSYNC_TCP_SOCKBUF_BYTES", "4294967296"},  // past setsockopt's int
      {"GRADSYNC_SHM_SPIN_US", "20us"},
      {"GRADSYNC_TIMEOUT", "0"},
      {"GRADSYNC_TIMEOUT", "5m"},
      {"GRADSYNC_COST_MODEL", "speed=3"},
      {"GRADSYNC_ALGO", "fastest"},
      {"GRADSYNC_TRANSPORT", "carrier-pigeon"},
  };
  for (auto [name, value] : garbage) {
    const std::string what = refused_by_resolve({{name, value}}).what();
    const std::string want =
        std::string(name) + "='" + value + "' is not " + std::string(knobs::find(name).accepts);
    EXPECT_TRUE(contains(what, want)) << what << "\nwants: " << want;
  }
  const std::string missing =
      refused_by_resolve({{"GRADSYNC_TOPOLOGY", "@/nonexistent/topology"}}).what();
  EXPECT_TRUE(contains(missing, "GRADSYNC_TOPOLOGY='@/nonexistent/topology' is not groups") &&
              contains(missing, "the file /nonexistent/topology cannot be read"))
      << missing;

  // An explicit field means the variable is not even read.
  KnobEnv env({{"GRADSYNC_TCP_SPIN_US", "fast"}, {"GRADSYNC_TIMEOUT", "never"}});
  Options explicit_options;
  explicit_options.tcp_spin_us = 5;
  explicit_options.timeout = std::chrono::milliseconds(100);
  EXPECT_EQ(env::resolve(explicit_options).tcp_spin_us, 5);
}

// Every integer knob and launcher variable refuses what lies outside its row's range, and
// what is no plain decimal integer, quoting the variable, the value and the range.
TEST(Knobs, IntegersOutsideTheirRangeAreRefusedNamingTheRange) {
  for (const knobs::Knob& k : knobs::all()) {
    if (k.max <= k.min) continue;
    const std::string name(k.name);
    for (const std::string& value :
         {std::to_string(k.min - 1), std::to_string(k.max + 1), std::string("99999999999999999999"),
          std::string("4294967296"), std::string("+1"), std::string(" 1"), std::string("1 "),
          std::string("0x10"), std::string("1e3"), std::string("1.0"), std::string("one")}) {
      SCOPED_TRACE(name + "=" + value);
      KnobEnv env({{name.c_str(), value.c_str()}});
      try {
        knobs::integer(name);
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
        const std::string want = name + "='" + value + "' is not " + std::string(k.accepts);
        EXPECT_TRUE(contains(e.what(), want)) << e.what() << "\nwants: " << want;
      }
    }
    KnobEnv env({{name.c_str(), std::to_string(k.max).c_str()}});
    EXPECT_EQ(knobs::integer(name), k.max) << name;
  }
}

// The launcher's variables go through the registry too: a rank past int's range is not taken
// for rank 0, port 0 is no port, and a rank beyond its world names the variable that set it.
TEST(Knobs, LauncherVariablesAreRefusedNamingTheVariable) {
  const struct {
    std::initializer_list<std::pair<const char*, const char*>> vars;
    std::string want;
  } cases[] = {
      {{{"RANK", "4294967296"}, {"WORLD_SIZE", "1"}},
       "RANK='4294967296' is not an integer in [0, WORLD_SIZE)"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK='-1' is not an integer in [0, WORLD_SIZE)"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}},
       "RANK='2' is not an integer in [0, WORLD_SIZE): the world size is 2"},
      {{{"PMI_RANK", "5"}, {"PMI_SIZE", "4"}},
       "PMI_RANK='5' is not an integer in [0, WORLD_SIZE): the world size is 4"},
      {{{"WORLD_SIZE", "0"}}, "WORLD_SIZE='0' is not an integer in [1, 1048576]"},
      {{{"SLURM_NTASKS", "99999999999"}}, "SLURM_NTASKS='99999999999' is not an integer in [1, "},
      {{{"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK='3' is not an integer in [0, LOCAL_WORLD_SIZE): the local world size is 2"},
      {{{"MASTER_PORT", "0"}}, "MASTER_PORT='0' is not an integer in [1, 65535]"},
      {{{"MASTER_PORT", "65536"}}, "MASTER_PORT='65536' is not an integer in [1, 65535]"},
      {{{"GRADSYNC_TIMEOUT", "99999999999999999"}},
       "GRADSYNC_TIMEOUT='99999999999999999' is not an integer in [1, 2147483647]"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.want);
    const std::string what = refused_by_resolve(c.vars).what();
    EXPECT_TRUE(contains(what, c.want)) << what;
    EXPECT_FALSE(contains(what, "rank -1")) << what;
  }
  // Explicit fields are checked as strictly.
  Options port_zero;
  port_zero.master_port = 0;
  EXPECT_TRUE(contains(refused_by_resolve({}, port_zero).what(), "master port 0 is outside"));
  Options beyond;
  beyond.rank = 3;
  beyond.size = 3;
  EXPECT_TRUE(contains(refused_by_resolve({}, beyond).what(), "rank 3 is outside [0, 3)"));
}

// GRADSYNC_ALGO's row names every spelling parse_algorithm takes, and each of them parses.
TEST(Knobs, AlgoNamesEveryValueItAccepts) {
  const std::string accepts(knobs::find("GRADSYNC_ALGO").accepts);
  for (const char* spelling :
       {"auto", "ring", "rd", "recursive_doubling", "hd", "halving_doubling", "rabenseifner", "ps",
        "parameter_server", "shm", "shared_memory", "hier", "hierarchical"}) {
    EXPECT_TRUE(parse_algorithm(spelling)) << spelling;
    EXPECT_TRUE(contains(accepts, spelling)) << spelling << " is accepted, yet not named";
  }
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kRecursiveDoubling,
                      Algorithm::kHalvingDoubling, Algorithm::kParameterServer,
                      Algorithm::kSharedMemory, Algorithm::kHierarchical}) {
    EXPECT_TRUE(contains(accepts, to_string(a))) << to_string(a);
  }
}

// gtest assertions in a forked child would be lost with it: it reports by exit status.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// Runs `fn` in a child process: init() numbers each rank's contexts per process, and ranks
// must agree on the number, so tests that call it do so in processes of their own.
void in_child(const std::function<void()>& fn) {
  auto status = testing::run_processes(1, [&](int) {
    fn();
    return 0;
  });
  EXPECT_TRUE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << "see the child's output";
}

// The message of the kInvalidArgument error `fn` throws.
std::string refusal_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::kInvalidArgument, e.what());
    return e.what();
  }
  require(false, "nothing was thrown");
  return "";
}

// A one-rank init() goes as far as choosing the interface and the ring: enough to see the
// errors name whichever of the field and the variable set the value.
TEST(Knobs, InitNamesTheSourceOfABadValue) {
  Options one;
  one.rank = 0;
  one.size = 1;
  {
    KnobEnv env({{"GRADSYNC_SOCKET_IFNAME", "nosuch0"}});
    in_child([&] {
      const std::string what = refusal_of([&] { init(one); });
      require(contains(what, "GRADSYNC_SOCKET_IFNAME='nosuch0': no interface nosuch0"), what);
      Options given = one;
      given.socket_ifname = "nosuch1";
      const std::string explicit_what = refusal_of([&] { init(given); });
      require(contains(explicit_what, "Options::socket_ifname='nosuch1'"), explicit_what);
      given.socket_ifname = "lo";  // beats the environment's bad name
      require(init(given)->size() == 1, "a context");
    });
  }
  KnobEnv env({{"GRADSYNC_TOPOLOGY", "0,7"}});
  in_child([&] {
    const std::string what = refusal_of([&] { init(one); });
    require(contains(what, "GRADSYNC_TOPOLOGY"), what);
  });
}

// Two ranks, in processes of their own (see in_child). The environment puts both on host
// "here" and fixes the cost model; rank 1 gives its host explicitly. Rank 0 shares memory
// with rank 1 only if it took the environment's id (its detected one differs) and rank 1's
// explicit id is the same; if rank 1's differs, they are two hosts over tcp, though the
// environment says "here" to both.
TEST(Knobs, InitUsesTheResolvedKnobs) {
  KnobEnv env({{"GRADSYNC_HOST_ID", "here"},
               {"GRADSYNC_COST_MODEL", "alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1"},
               {"GRADSYNC_TCP_SPIN_US", "0"},
               {"GRADSYNC_SHM_SPIN_US", "0"}});
  for (const std::string rank1_host : {"here", "there"}) {
    SCOPED_TRACE("rank 1 on " + rank1_host);
    const bool one_host = rank1_host == "here";
    testing::TempDir dir;
    auto statuses = testing::run_processes(2, [&](int rank) {
      Options o;
      o.rank = rank;
      o.size = 2;
      o.store = make_file_store(dir.path());
      o.timeout = std::chrono::seconds(30);
      if (rank == 1) o.host_id = rank1_host;
      auto ctx = init(o);
      require(ctx->hosts() == (one_host ? 1 : 2), ctx->topology());
      const std::string transport = ctx->transport_name(1 - rank);
      require(transport == (one_host ? "shm" : "tcp"), transport);
      require(contains(ctx->cost_model(), "alpha_us=500"), ctx->cost_model());
      ctx->barrier();
      return 0;
    });
    for (int status : statuses) EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

// The tcp transport applies what TcpOptions carries.
TEST(Knobs, TcpTuningFollowsTcpOptions) {
  auto option = [](int fd, int level, int name) {
    int value = 0;
    socklen_t len = sizeof value;
    EXPECT_EQ(::getsockopt(fd, level, name, &value, &len), 0);
    return value;
  };
  transport::TcpOptions tcp;
  tcp.liveness_s = 6;
  tcp.socket_buffer_bytes = 200000;
  const int tuned = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(tuned, 0);
  transport::tcp::tune_socket(tuned, tcp);
  EXPECT_EQ(option(tuned, SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(option(tuned, IPPROTO_TCP, TCP_USER_TIMEOUT), 6000);
  EXPECT_GE(option(tuned, SOL_SOCKET, SO_SNDBUF), tcp.socket_buffer_bytes);
  ::close(tuned);

  tcp.liveness_s = 0;
  const int off = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(off, 0);
  transport::tcp::tune_socket(off, tcp);
  EXPECT_EQ(option(off, SOL_SOCKET, SO_KEEPALIVE), 0);
  ::close(off);

  using transport::tcp::choose_spin;
  EXPECT_EQ(choose_spin(1, 7).duration, std::chrono::microseconds(7));
  EXPECT_EQ(choose_spin(1, -1).duration, transport::tcp::kBusySpin);
  const auto crowded = choose_spin(100000, -1);
  EXPECT_TRUE(crowded.yield);
  EXPECT_EQ(crowded.duration, transport::tcp::kYieldSpin);
  EXPECT_EQ(choose_spin(100000, 0).duration, std::chrono::nanoseconds(0));
}

}  // namespace
}  // namespace gradsync
