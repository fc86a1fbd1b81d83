"""The C++ standard fused's sources compile with against a torch: the -std that torch.utils.cpp_extension's
BuildExtension adds to an extension that names none (setup.py names none, so this is what a build uses), else,
for a torch whose BuildExtension names none or for bare headers, from the version: c++20 from torch 2.14 on (its
ATen.h refuses anything older), c++17 before.

  python tools/torch_cxx_std.py           the installed torch's, e.g. c++20
  python tools/torch_cxx_std.py 2.14.1    a torch known by its version only (headers without the package)
"""

import inspect
import re
import sys


def std_for_version(version):
    major, minor = (int(v) for v in re.match(r"(\d+)\.(\d+)", version).groups())
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def installed_torch_std():
    import torch
    from torch.utils import cpp_extension

    # BuildExtension appends cpp_flag_prefix + 'c++NN' where no -std is given (append_std17_if_no_std_present).
    found = set(re.findall(r"'c\+\+(\d\d)'", inspect.getsource(cpp_extension.BuildExtension)))
    return f"c++{found.pop()}" if len(found) == 1 else std_for_version(torch.__version__)


if __name__ == "__main__":
    print(std_for_version(sys.argv[1]) if len(sys.argv) > 1 else installed_torch_std())
