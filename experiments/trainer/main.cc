// The memlean trainer binary: see trainer.h and --help.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "experiments/trainer/trainer.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  return memlean::trainer::trainer_main(args, std::cout, std::cerr, isatty(STDERR_FILENO) != 0);
}
