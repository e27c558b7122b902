// gradsync-train: data-parallel training of an MLP or a small CNN on Fashion-MNIST, one
// process per rank (start it with gradsync-run), with every lever of the library on a flag:
// the codec, the buckets, overlap, accumulation, ZeRO, the optimizer.
//
//   gradsync-run -n 4 -- gradsync-train --model mlp --epochs 2 --codec fp16 --json run.json
//
// The parts: train/flags (the command line), train/training (the loop), train/checkpoint
// (save and resume), train/report (progress, summary and --json).
#include <cstdio>
#include <exception>
#include <new>

#include "train/flags.h"
#include "train/training.h"

int main(int argc, char** argv) {
  const train::Config c = train::parse_flags(argc, argv);
  try {
    return train::run_training(c);
  } catch (const std::bad_alloc&) {  // the flags' ranges fit a machine, not every machine
    std::fprintf(stderr,
                 "gradsync-train: out of memory: lower --batch or --hidden, or run fewer ranks on "
                 "this host\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradsync-train: %s\n", e.what());
    return 1;
  }
}
