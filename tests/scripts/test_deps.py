"""scripts/deps.sh declares every Debian package the build, `make run` and `make test` need.

A machine that already has the packages cannot see a missing declaration, so this test looks at
what the project really uses on this machine and asks dpkg who owns it:
  - every system header the build included (the compiler's dependency files, $BUILD/obj/**/*.d),
  - every system .proto it compiled (the well-known types generated under $BUILD/gen),
  - every program the scripts, Makefile and tests run (read from their text),
  - every Python module the tests and scripts import.
Each owning package must be declared in scripts/deps.sh or pulled in by a declared package (the
Depends/Pre-Depends closure over installed packages), or be part of the base system every
Debian machine has (Essential or Priority: required), or be a stated prerequisite (git).
Run by tests/run.sh with Debian's /usr/bin/python3.
"""
import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, os.environ.get("BUILD", "build"))
PREREQUISITES = {"git"}  # README: a Debian 12 machine, root or sudo, git and make

# Words that start a shell command but are not programs of their own, and words after which
# the next word is the program (`timeout 5 prog`, `runuser -u postgres -- prog`).
SHELL_WORDS = {
    "if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac",
    "in", "function", "select", "time", "!", "{", "}", "[[", "]]", "local", "export",
    "declare", "readonly", "return", "exit", "set", "unset", "shift", "trap", "wait", "eval",
    "source", ".", "cd", "pushd", "popd", "read", "printf", "echo", "true", "false", "test",
    "[", "break", "continue", "exec", "command", "builtin", "type", "hash", "kill", "let",
    "ulimit", "umask", "shopt", "getopts", "mapfile", "readarray", "jobs", "disown", "alias",
    "pwd",
}
PREFIX_WORDS = {"exec", "command", "nohup", "setsid", "sudo", "xargs", "env", "nice", "stdbuf"}


def read(path):
    with open(path) as f:
        return f.read()


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------- declared packages ----

def declared_packages():
    out = run(["bash", os.path.join(ROOT, "scripts", "deps.sh"), "--list"], check=True).stdout
    return set(out.split())


def installed_graph():
    """name -> (deps (list of alternative lists), essential/required flag, provides)."""
    fmt = "${Package}\t${db:Status-Status}\t${Essential}\t${Priority}\t${Depends}\t" \
          "${Pre-Depends}\t${Provides}\n"
    out = run(["dpkg-query", "-W", "-f=" + fmt], check=True).stdout
    pkgs, providers = {}, {}
    for line in out.splitlines():
        name, status, essential, priority, dep, predep, provides = (line.split("\t") + [""] * 7)[:7]
        if status != "installed":
            continue
        alts = []
        for clause in filter(None, (c.strip() for c in (dep + "," + predep).split(","))):
            alts.append([re.split(r"[\s(:]", a.strip(), 1)[0] for a in clause.split("|")])
        base = essential == "yes" or priority == "required"
        pkgs[name] = (alts, base)
        for p in filter(None, (x.strip() for x in provides.split(","))):
            providers.setdefault(re.split(r"[\s(]", p, 1)[0], []).append(name)
    return pkgs, providers


def closure(roots, pkgs, providers):
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        for real in ([name] if name in pkgs else providers.get(name, [])):
            if real in seen:
                continue
            seen.add(real)
            for alts in pkgs[real][0]:
                # every installed alternative counts: whichever a fresh machine picks, the
                # declared package pulls one in, and dpkg -S below names the one we have
                todo.extend(a for a in alts if a in pkgs or a in providers)
    return seen


# ---------------------------------------------------------------- what we use ----

def system_headers():
    paths = set()
    for d in glob.glob(os.path.join(BUILD, "obj", "**", "*.d"), recursive=True):
        with open(d) as f:
            for tok in f.read().replace("\\\n", " ").split():
                tok = tok.rstrip(":")
                if tok.startswith("/usr/") and not tok.startswith(BUILD):
                    paths.add(os.path.normpath(tok))
    return paths


def system_protos():
    gen = os.path.join(BUILD, "gen", "google", "protobuf")
    return {"/usr/include/google/protobuf/%s.proto" % os.path.basename(p)[:-len(".pb-c.c")]
            for p in glob.glob(os.path.join(gen, "*.pb-c.c"))}


def strip_comment(line):
    quote, out = None, []
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t;"):
            break
        out.append(ch)
    return "".join(out)


def shell_commands(text, variables=None):
    """First words of every command segment of shell text (a heuristic, over-approximate)."""
    variables = dict(variables or {})
    functions = set(re.findall(r"^\s*(?:function\s+)?([A-Za-z_][\w-]*)\s*\(\)", text, re.M))
    for m in re.finditer(r"^\s*(?:readonly\s+|export\s+)?([A-Z_][A-Z0-9_]*)=([^\s$`'\"]+)\s*$",
                         text, re.M):
        variables.setdefault(m.group(1), m.group(2))
    cmds = set()
    heredoc = None  # the delimiter while inside a here-document: its body is data, not commands
    for raw in text.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*['\"]?([A-Za-z_]\w*)['\"]?", raw)
        if m:
            heredoc = m.group(1)
        line = strip_comment(raw)
        for seg in re.split(r"\|\||&&|[|;&`(){}]|\$\(|\bthen\b|\bdo\b|\belse\b|\bif\b|\bwhile\b"
                            r"|\buntil\b|\btime\b|!", line):
            words = seg.replace('"', " ").replace("'", " ").split()
            while words:
                w = words[0]
                if re.match(r"^[A-Za-z_]\w*=", w) or w.startswith(("<", ">", "2>", "1>", "-")) \
                        or w in PREFIX_WORDS or re.match(r"^\d+$", w):
                    words.pop(0)
                    continue
                if w == "timeout":
                    words.pop(0)
                    while words and (words[0].startswith("-") or re.match(r"^[\d.]+[smhd]?$",
                                                                         words[0])):
                        words.pop(0)
                    continue
                if w == "runuser":
                    words = words[words.index("--") + 1:] if "--" in words else []
                    continue
                break
            if not words:
                continue
            w = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), "$"),
                       words[0])
            if "$" in w or w in SHELL_WORDS or w in functions or w.endswith(")"):
                continue
            cmds.add(w)
    return cmds


def makefile_commands(path):
    text = read(path)
    variables = {}
    for m in re.finditer(r"^([A-Z_]+)\s*[?:]?=\s*(\S+)\s*$", text, re.M):
        variables.setdefault(m.group(1), m.group(2))
    recipe = []
    for line in text.splitlines():
        if line.startswith("\t"):
            recipe.append(line.lstrip("\t@-"))
    recipe += re.findall(r"\$\(shell ([^)]*)\)", text)
    body = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), "$" + m.group(1)),
                  "\n".join(recipe))
    return shell_commands(body.replace("$$", "$"))


def python_commands_and_imports(path):
    tree = ast.parse(read(path), path)
    cmds, mods = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name not in ("run", "Popen", "check_output", "check_call", "call", "which"):
                continue
            a = node.args[0]
            if isinstance(a, (ast.List, ast.Tuple)) and a.elts:
                a = a.elts[0]
            elif isinstance(a, ast.BinOp) and isinstance(a.left, (ast.List, ast.Tuple)) \
                    and a.left.elts:
                a = a.left.elts[0]
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value:
                cmds.add(a.value.split()[0])
    return cmds, mods


def c_commands(path):
    text = read(path)
    if not re.search(r"\b(system|popen|execl|execlp|execvp)\s*\(", text):
        return set()
    # only literals with a space: a command line, not a mode string such as "w"
    literals = [l for l in re.findall(r'"((?:[^"\\]|\\.)*)"', text) if " " in l.strip()]
    return {w for w in shell_commands("\n".join(literals)) if shutil.which(w)}


def repo_files(*patterns):
    files = set()
    for p in patterns:
        files.update(glob.glob(os.path.join(ROOT, p), recursive=True))
    return sorted(f for f in files if "/build" not in os.path.relpath(f, ROOT)[:7]
                  and "node_modules" not in f)


def programs_used():
    """program path -> first file that runs it."""
    found = {}

    def note(cmds, where):
        for c in cmds:
            if c.startswith("/"):
                if not (os.path.isfile(c) and os.access(c, os.X_OK)):
                    continue  # a path built at run time ($(dirname "$0")/.., /tmp/x-*)
                path = c
            elif "/" in c:
                continue  # a file of the checkout (scripts/x.sh, $BUILD/bin/prog)
            else:
                path = shutil.which(c)
                if path is None:
                    # not a program on this machine: the heuristic read a word of a string or
                    # a heredoc (a program this machine lacks fails its test anyway)
                    continue
            found.setdefault(path, where)

    for f in repo_files("scripts/*.sh", "tests/**/*.sh", "bench/**/*.sh", ".ci/run"):
        note(shell_commands(read(f)), os.path.relpath(f, ROOT))
    note(makefile_commands(os.path.join(ROOT, "Makefile")), "Makefile")
    for f in repo_files("**/*.mk"):
        note(makefile_commands(f), os.path.relpath(f, ROOT))
    for f in repo_files("tests/**/*.py", "scripts/*.py", "bench/**/*.py"):
        note(python_commands_and_imports(f)[0], os.path.relpath(f, ROOT))
    for f in repo_files("tests/**/*.c", "tests/**/*.h", "bench/**/*.c"):
        note(c_commands(f), os.path.relpath(f, ROOT))
    return found


def python_modules():
    mods = {}
    for f in repo_files("tests/**/*.py", "scripts/*.py", "bench/**/*.py"):
        for m in python_commands_and_imports(f)[1]:
            mods.setdefault(m, os.path.relpath(f, ROOT))
    return mods


def module_origins(mods):
    """module -> file it loads from, with Debian's python and the tests' own sys.path."""
    code = (
        "import importlib.util, sys\n"
        "sys.path[:0] = %r\n"
        "for m in %r:\n"
        "    try:\n"
        "        s = importlib.util.find_spec(m)\n"
        "    except Exception:\n"
        "        s = None\n"
        "    o = (s.origin or (list(s.submodule_search_locations or [''])[0])) if s else ''\n"
        "    print(m, o if o not in (None, 'built-in', 'frozen') else 'builtin:' + sys.executable)\n"
    ) % ([os.path.join(ROOT, "tests", "lib"), os.path.join(BUILD, "py")] +
         # a test's own folder comes first on its sys.path (helpers next to the tests)
         sorted({os.path.dirname(f) for f in repo_files("tests/**/*.py", "scripts/*.py",
                                                        "bench/**/*.py")}), sorted(mods))
    out = run(["/usr/bin/python3", "-c", code], check=True).stdout
    res = {}
    for line in out.splitlines():
        m, _, origin = line.partition(" ")
        res[m] = origin.replace("builtin:", "")
    return res


def unmerged(path):
    """/usr/bin/mkdir -> /bin/mkdir: with merged /usr, dpkg still records the old location."""
    for d in ("/usr/bin/", "/usr/sbin/", "/usr/lib/", "/usr/lib64/"):
        if path.startswith(d):
            return path[len("/usr"):]
    return path


def owners(paths):
    """path -> set of packages (empty when dpkg knows no owner)."""
    res = {p: set() for p in paths}
    todo = sorted(paths)
    for i in range(0, len(todo), 200):
        chunk = todo[i:i + 200]
        for q in (chunk, [os.path.realpath(p) for p in chunk], [unmerged(p) for p in chunk]):
            out = run(["dpkg-query", "-S"] + q).stdout
            for line in out.splitlines():
                if line.startswith("diversion "):
                    continue
                pk, sep, path = line.partition(": ")
                if not sep:
                    continue
                for orig in chunk:
                    if path in (orig, os.path.realpath(orig), unmerged(orig)):
                        res[orig].update(x.strip().split(":")[0] for x in pk.split(","))
    return res


class DeclaredPackages(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.declared = declared_packages()
        pkgs, providers = installed_graph()
        cls.base = {n for n, (_, b) in pkgs.items() if b} | PREREQUISITES
        cls.covered = closure(cls.declared | cls.base, pkgs, providers)

    def check(self, what, used):
        """used: path -> where it is used."""
        own = owners(set(used))
        problems = []
        for path, where in sorted(used.items()):
            if not own[path]:
                problems.append("%s (%s, used by %s) belongs to no Debian package" %
                                (path, what, where))
            elif not own[path] & self.covered:
                problems.append("%s (%s, used by %s) comes from %s, which scripts/deps.sh does "
                                "not declare (nor pulls in)" %
                                (path, what, where, "/".join(sorted(own[path]))))
        self.assertFalse(problems, "\n" + "\n".join(problems))

    def test_declared_packages_exist(self):
        pkgs, providers = installed_graph()
        missing = sorted(p for p in self.declared if p not in pkgs and p not in providers)
        self.assertFalse(missing, "declared but not installed here (run make deps): %s" % missing)

    def test_system_headers(self):
        used = {p: "the build" for p in system_headers()}
        self.assertGreater(len(used), 20, "no dependency files under %s/obj: build first" % BUILD)
        self.assertTrue(any("/grpc/" in p for p in used), "headers of libgrpc-dev not seen")
        self.check("header", used)

    def test_system_protos(self):
        used = {p: "the build" for p in system_protos()}
        self.assertIn("/usr/include/google/protobuf/struct.proto", used)
        self.check("proto", used)

    def test_programs(self):
        found = programs_used()
        used = dict(found)
        for must in ("protoc-c", "psql", "openssl", "npm", "node", "valgrind"):
            self.assertTrue(any(os.path.basename(p) == must for p in used),
                            "%s not seen among the programs the project runs" % must)
        self.check("program", used)

    def test_python_modules(self):
        mods = python_modules()
        self.assertIn("grpc", mods)
        origins = module_origins(mods)
        unresolved = sorted("%s (imported by %s)" % (m, mods[m]) for m, o in origins.items()
                            if not o)
        self.assertFalse(unresolved, "modules not installed for /usr/bin/python3: %s" % unresolved)
        used = {o: "import %s (%s)" % (m, mods[m]) for m, o in origins.items()
                if o and not o.startswith((ROOT + "/", BUILD + "/"))}
        self.check("python module", used)

if __name__ == "__main__":
    unittest.main(verbosity=1)
