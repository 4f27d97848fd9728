// The calling thread's last error message (stof_last_error_message).
#include <cstdarg>
#include <cstdio>

#include "host.h"

namespace {
thread_local char tLastError[512] = "";
}

namespace stof {
namespace host {

stof_status_t fail(stof_status_t s, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(tLastError, sizeof(tLastError), fmt, ap);
    va_end(ap);
    return s;
}

void clear_error() { tLastError[0] = '\0'; }

}  // namespace host
}  // namespace stof

extern "C" STOF_API const char* stof_last_error_message(void) { return tLastError; }
