// The trainer's data: synthetic batches generated from the seed (hermetic and repeatable),
// or CIFAR-10 in its binary format. Bad CIFAR-10 folders and files are UsageErrors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "experiments/trainer/config.h"

namespace memlean::trainer {

struct Batch {
  at::Tensor input;   // float32 on the CPU
  at::Tensor target;  // int64 labels [batch], or float32 [batch, outputs] for regression
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual Batch next() = 0;
  virtual std::string describe() const = 0;
};

// Images [batch, 3, size, size] of `classes` classes: each class has a fixed smooth random
// pattern (from the seed: a colour plus 4 x 4 values per channel, upsampled) and an image is its class's
// pattern plus unit Gaussian noise, so a model can learn it. The same seed gives the same batches.
std::unique_ptr<DataSource> synthetic_images(int64_t batch, int64_t classes, int64_t size,
                                             uint64_t seed);

// The Swish blog post's regression (docs/sources.md): x ~ N(0, 1) [batch, in], target
// tanh(x W) [batch, out] for a fixed random W (from the seed).
std::unique_ptr<DataSource> synthetic_regression(int64_t batch, int64_t in, int64_t out,
                                                 uint64_t seed);

// CIFAR-10, binary version: records of 1 label byte (0-9) and 3072 pixel bytes (1024 red,
// 1024 green, 1024 blue, row-major 32 x 32).
constexpr int64_t kCifarPixels = 3 * 32 * 32;
constexpr int64_t kCifarRecord = 1 + kCifarPixels;

struct Cifar10 {
  std::vector<std::string> files;  // the data_batch_*.bin files read, sorted
  std::vector<uint8_t> labels;     // one per image
  std::vector<uint8_t> pixels;     // kCifarPixels per image
  int64_t size() const { return static_cast<int64_t>(labels.size()); }
};

// Reads every data_batch_*.bin in `dir` (test_batch.bin is not read). UsageError when the
// folder is missing, holds no data_batch_*.bin, or a file is empty, not a whole number of
// records, unreadable, or has a label above 9.
Cifar10 read_cifar10(const std::string& dir);

// Batches of CIFAR-10, reshuffled every epoch from the seed, as float32 [batch, 3, 32, 32]
// normalised with the per-channel mean and standard deviation of the training set. The
// images live in a plain std::vector (not a tensor), so memstats does not count them: only
// the batch of each step is.
std::unique_ptr<DataSource> cifar10_batches(Cifar10 data, int64_t batch, uint64_t seed);

// The source for a Config.
std::unique_ptr<DataSource> make_data(const Config& config);

}  // namespace memlean::trainer
