#include "gradsync/version.h"

namespace gradsync {

const char* version() {
  return GRADSYNC_VERSION_STRING;
}

}  // namespace gradsync
