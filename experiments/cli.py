"""Flag parsing shared by the experiments/ programs (`app.run(main, flags_parser=...)`).

* A bad flag (an unknown `--config.*` field, a value of the wrong type) exits with status 2 and
  one line naming it, not a traceback.
* `--help` (also `-?`, `--helpshort`, `--helpfull`) prints the usage (the program's module
  docstring and its flags) and exits with status 0: asking for help is no failure (absl's own
  help flags print the same usage and exit 1).
"""

from __future__ import annotations

import sys

from absl import flags

HELP_FLAGS = ("help", "?", "helpshort", "helpfull")


def _asks_for_help(argv: list[str]) -> bool:
  for arg in argv[1:]:
    if arg == "--":
      return False
    name = arg.lstrip("-").split("=", 1)[0]
    if arg.startswith("-") and name in HELP_FLAGS:
      return True
  return False


def _usage(flag_values: flags.FlagValues) -> str:
  main = sys.modules.get("__main__")
  doc = (getattr(main, "__doc__", None) or "").strip()
  return f"{doc}\n\nflags:\n\n{flag_values.get_help()}\n"


def parse_flags(argv: list[str], flag_values: flags.FlagValues | None = None) -> list[str]:
  """Parses argv into `flag_values` (default absl's global FLAGS); returns the remaining
  arguments. See the module docstring for the exits."""
  values = flags.FLAGS if flag_values is None else flag_values
  if values is not flags.FLAGS and _asks_for_help(argv):
    print(_usage(values))  # a program's own flag set has no --help flag of absl's
    sys.exit(0)
  try:
    return values(argv)
  except SystemExit as e:
    # absl's help flags print the usage and then exit with status 1.
    sys.exit(0 if e.code == 1 and _asks_for_help(argv) else e.code)
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    print(f"error: invalid command line: {_message(e, argv)}", file=sys.stderr)
    sys.exit(2)



def own_flags_parser(flag_values: flags.FlagValues):
  """`app.run`'s flags_parser for a program with its own flag set (not absl's global one, so
  its functions can be imported beside programs defining the same names): parses argv into
  `flag_values` as `parse_flags` does; absl's own flags keep their defaults."""
  def parse(argv: list[str]) -> list[str]:
    rest = parse_flags(argv, flag_values)
    flags.FLAGS(rest[:1])
    return rest
  return parse

def _message(error: Exception, argv: list[str]) -> str:
  """One line for a parse error; an unknown config field names the flag that set it
  (ml_collections raises a KeyError with only the key, wrapped in an AttributeError)."""
  inner = error
  while inner.args and isinstance(inner.args[0], BaseException):
    inner = inner.args[0]
  if isinstance(inner, KeyError):
    text = str(inner.args[0]) if inner.args else ""
    key = text.split("\n")[0].strip("'\"")
    culprits = [a for a in argv[1:] if a.startswith("--") and "." in a.split("=", 1)[0]
                and key in a.split("=", 1)[0].lstrip("-").split(".")]
    message = f"unknown config field{' in ' + culprits[0] if culprits else ''}: {text}"
  else:
    message = str(error)
  return " ".join(message.split())
