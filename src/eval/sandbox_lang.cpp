// What each language of code sample runs in the sandbox (docs/evaluation.md, "Code: pass@k in
// a sandbox"): the guard that runs the program and writes the sentinel after it, the files in
// /box, the command line, the environment and the address-space limit.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/error.h"
#include "eval/sandbox_child.h"

namespace fs = std::filesystem;

namespace sigma::eval {

const char* language_name(SandboxLanguage l) { return l == SandboxLanguage::Java ? "java" : "python"; }

namespace detail {

namespace {

// Installed before the sample runs; an audit hook cannot be removed from Python code. After the
// program (sample and tests) returns, the guard writes the sentinel to fd 3: an early exit
// (sys.exit, os._exit, SystemExit from anywhere) never reaches that line.
constexpr const char* kPythonGuard = R"PY(import os, sys
_root = os.path.realpath(os.getcwd())
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        r = os.path.realpath(os.fsdecode(p))
    except Exception:
        return False
    return r == _root or r.startswith(_root + os.sep)
_deny = {'os.fork', 'os.forkpty', 'os.posix_spawn', 'os.spawn', 'os.exec', 'os.system',
         'subprocess.Popen', 'socket.__new__', 'socket.connect', 'socket.bind', 'os.setuid',
         'pty.spawn', 'os.startfile'}
_paths = {'os.remove', 'os.rename', 'os.mkdir', 'os.rmdir', 'os.chmod', 'os.chown',
          'os.symlink', 'os.link', 'os.truncate', 'os.utime', 'shutil.rmtree', 'shutil.copyfile'}
_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def _hook(event, args):
    if event in _deny or event.startswith('ctypes.'):
        raise PermissionError('sandbox: ' + event + ' is not allowed')
    if event == 'open':
        path, mode, flags = args
        w = any(c in mode for c in 'wax+') if isinstance(mode, str) else bool(flags & _write)
        if w and not _inside(path):
            raise PermissionError('sandbox: writing outside the sandbox: ' + str(path))
    elif event in _paths:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError('sandbox: ' + event + ' outside the sandbox: ' + str(p))
sys.addaudithook(_hook)
del _hook
_end = os.write
with open('sample.py', 'rb') as _f:
    _code = compile(_f.read(), 'sample.py', 'exec')
exec(_code, {'__name__': '__main__'})
_end(3, b'SIGMA-SANDBOX-END\n')
)PY";

// Java: the guard is a class of its own, run by the JVM's source launcher (`java
// SigmaGuard.java`, compiled in memory). It compiles Main.java (the sample: prompt, completion
// and tests, whose class Main has the main method) with the JDK's compiler in the same JVM
// (one JVM start, not a javac and a java), loads it, runs Main.main, and after it returns
// writes the sentinel to fd 3 (the JDK has no public API for a raw descriptor: the guard sets
// FileDescriptor.fd, hence --add-opens java.base/java.io). A compile error or an exception
// out of main ends it with status 1 and the error as the last line of the output. There is no
// audit hook (Java's SecurityManager is deprecated): the OS-level sandbox is the boundary.
constexpr const char* kJavaGuard = R"JAVA(import java.io.*;
import java.lang.reflect.*;
import java.net.*;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import javax.tools.*;

public final class SigmaGuard {
  public static void main(String[] args) throws Throwable {
    JavaCompiler javac = ToolProvider.getSystemJavaCompiler();
    DiagnosticCollector<JavaFileObject> diags = new DiagnosticCollector<>();
    StandardJavaFileManager files = javac.getStandardFileManager(diags, null, StandardCharsets.UTF_8);
    Files.createDirectories(Paths.get("classes"));
    boolean ok = javac.getTask(null, files, diags, java.util.List.of("-d", "classes", "-g:none", "-nowarn",
        "-proc:none", "-encoding", "UTF-8"), null, files.getJavaFileObjects("Main.java")).call();
    if (!ok) {
      for (Diagnostic<? extends JavaFileObject> d : diags.getDiagnostics())
        if (d.getKind() == Diagnostic.Kind.ERROR)
          System.err.println("compile error: Main.java:" + d.getLineNumber() + ": " + d.getMessage(null).split("\n")[0]);
      System.exit(1);
    }
    ClassLoader loader = new URLClassLoader(new URL[] {Paths.get("classes").toUri().toURL()},
                                            SigmaGuard.class.getClassLoader());
    Method main = Class.forName("Main", true, loader).getMethod("main", String[].class);
    try {
      main.invoke(null, (Object) new String[0]);
    } catch (InvocationTargetException e) {
      Throwable t = e.getCause();
      t.printStackTrace();
      System.err.println(t.toString().replace('\n', ' '));
      System.exit(1);
    }
    FileDescriptor fd = new FileDescriptor();
    Field f = FileDescriptor.class.getDeclaredField("fd");
    f.setAccessible(true);
    f.setInt(fd, 3);
    try (FileOutputStream end = new FileOutputStream(fd)) {
      end.write("SIGMA-SANDBOX-END\n".getBytes(StandardCharsets.US_ASCII));
    }
  }
}
)JAVA";

// The program's real path (what the sample's root must hold): /usr/bin/NAME unless `chosen`
// names another, which is looked up on PATH as execvp would.
std::string program_path(const std::string& chosen, const std::string& name, const char* install) {
  const std::string usr = "/usr/bin/" + name;
  std::string exe = chosen.empty() && ::access(usr.c_str(), X_OK) == 0 ? usr : chosen.empty() ? name : chosen;
  if (exe.find('/') == std::string::npos)
    if (const char* path = std::getenv("PATH"))
      for (std::string_view rest = path; !rest.empty();) {
        const size_t c = rest.find(':');
        const fs::path cand = fs::path(std::string(rest.substr(0, c))) / exe;
        if (::access(cand.c_str(), X_OK) == 0) { exe = cand.string(); break; }
        rest = c == std::string_view::npos ? std::string_view() : rest.substr(c + 1);
      }
  std::error_code ec;
  const fs::path real = fs::canonical(exe, ec);
  SIGMA_CHECK(!ec, "sandbox: cannot find {} ({}): {}; {}", name, exe, ec.message(), install);
  return real.string();
}


}  // namespace

LanguagePlan plan_language(SandboxLanguage language, const SandboxLimits& limits, bool memcg) {
  LanguagePlan l;
  l.env = {"PATH=/usr/bin:/bin", "HOME=/box", "TMPDIR=/box", "LANG=C.UTF-8"};
  if (language == SandboxLanguage::Python) {
    l.exe = program_path(limits.python, "python3", "install python3 (scripts/install-deps.sh)");
    l.guard = kPythonGuard;
    l.guard_file = "guard.py";
    l.program_file = "sample.py";
    l.args = {l.exe, "-I", "-B", "guard.py"};
    l.address_space = limits.memory_bytes;
    l.audit_hook = true;
    return l;
  }
  l.exe = program_path(limits.java, "java", "install a JDK: default-jdk-headless (scripts/install-deps.sh)");
  // The launcher finds libjli.so through its RPATH $ORIGIN/../lib, which ld.so resolves by
  // /proc/self/exe: the sample's root has no /proc, so the library folder is named instead.
  l.env.push_back("LD_LIBRARY_PATH=" + (fs::path(l.exe).parent_path().parent_path() / "lib").string());
  l.guard = kJavaGuard;
  l.guard_file = "SigmaGuard.java";
  l.program_file = "Main.java";
  // Measured (docs/evaluation.md, "Java"): the JVM with these flags compiling and running a
  // small sample peaks at ~100 MiB resident besides its heap and 13 threads, and reserves
  // ~1.4 GiB of address space at -Xmx256m. The heap gets what that leaves of memory_bytes.
  constexpr uint64_t kNonHeap = 256ull << 20, kLeastHeap = 64ull << 20;
  SIGMA_CHECK(limits.memory_bytes >= kNonHeap + kLeastHeap, "sandbox: a Java sample needs a memory limit of at "
              "least {} MiB (the JVM's own ~100 MiB plus a heap), not {} MiB", (kNonHeap + kLeastHeap) >> 20,
              limits.memory_bytes >> 20);
  const uint64_t heap_mib = (limits.memory_bytes - kNonHeap) >> 20;
  l.args = {l.exe,
            "-XX:+UseSerialGC",             // no GC threads
            "-XX:TieredStopAtLevel=1",      // C1 only: fast start, samples are short
            "-XX:ActiveProcessorCount=1",   // single-threaded compilation and runtime ergonomics
            "-XX:CICompilerCount=1",
            "-Xss4m",                       // recursive solutions
            fmt::format("-Xmx{}m", heap_mib),
            "-XX:ReservedCodeCacheSize=32m",  // smaller reservations (1.4 GiB instead of ~3)
            "-XX:CompressedClassSpaceSize=64m",
            "-XX:MaxMetaspaceSize=128m",
            "-XX:-UsePerfData",             // no /tmp/hsperfdata_USER (there is no /tmp)
            "-Xshare:auto",
            "-Djava.io.tmpdir=/box",
            "-Duser.home=/box",
            "-ea",                          // the tests' assert statements
            // ProcessBuilder's default (posix_spawn of jspawnhelper) fails without /proc (exit
            // 127); a plain fork + exec needs nothing, and RLIMIT_NPROC bounds it.
            "-Djdk.lang.Process.launchMechanism=FORK",
            "--add-opens=java.base/java.io=ALL-UNNAMED",  // the guard's sentinel (fd 3)
            "SigmaGuard.java"};
  // The JVM reserves far more address space than it uses, so RLIMIT_AS would break it: the
  // memory cgroup bounds all its processes together. Without a cgroup the per-process bound is
  // the heap plus 2 GiB of reservations (measured 1.4 GiB).
  l.address_space = memcg ? 0 : (heap_mib << 20) + (2ull << 30);
  return l;
}

}  // namespace detail

}  // namespace sigma::eval
