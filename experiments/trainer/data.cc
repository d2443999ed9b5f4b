// Synthetic data and the CIFAR-10 binary reader.
#include "experiments/trainer/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <regex>
#include <sstream>
#include <utility>

namespace memlean::trainer {
namespace {

namespace fs = std::filesystem;

// The data's generator is seeded apart from the global one (the model's initialisation and
// dropout), so that the data does not depend on the model and the other way round.
at::Generator data_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x6d656d6c65616eULL);  // "memlean"
}

class SyntheticImages : public DataSource {
 public:
  SyntheticImages(int64_t batch, int64_t classes, int64_t size, uint64_t seed)
      : batch_(batch), classes_(classes), size_(size), gen_(data_generator(seed)) {
    // Smooth patterns: a colour per class plus a coarse layout (4 x 4 random values per
    // channel, upsampled), which convolutions and global pooling pick up as easily as an MLP.
    patterns_ = at::randn({classes, 3, 1, 1}, gen_) +
                at::upsample_bilinear2d(at::randn({classes, 3, 4, 4}, gen_), {size, size},
                                        /*align_corners=*/false);
  }
  Batch next() override {
    at::Tensor labels = at::randint(classes_, {batch_}, gen_, at::kLong);
    at::Tensor x = patterns_.index_select(0, labels) + at::randn({batch_, 3, size_, size_}, gen_);
    return {x, labels};
  }
  std::string describe() const override {
    std::ostringstream s;
    s << "synthetic images " << size_ << "x" << size_ << ", " << classes_ << " classes";
    return s.str();
  }

 private:
  int64_t batch_, classes_, size_;
  at::Generator gen_;
  at::Tensor patterns_;
};

class SyntheticRegression : public DataSource {
 public:
  SyntheticRegression(int64_t batch, int64_t in, int64_t out, uint64_t seed)
      : batch_(batch), in_(in), out_(out), gen_(data_generator(seed)) {
    w_ = at::randn({in, out}, gen_) / std::sqrt(static_cast<double>(in));
  }
  Batch next() override {
    at::Tensor x = at::randn({batch_, in_}, gen_);
    return {x, at::tanh(at::matmul(x, w_))};
  }
  std::string describe() const override {
    std::ostringstream s;
    s << "synthetic regression " << in_ << " -> " << out_;
    return s.str();
  }

 private:
  int64_t batch_, in_, out_;
  at::Generator gen_;
  at::Tensor w_;
};

class Cifar10Batches : public DataSource {
 public:
  Cifar10Batches(Cifar10 data, int64_t batch, uint64_t seed)
      : data_(std::move(data)), batch_(batch), gen_(data_generator(seed)) {}

  Batch next() override {
    std::vector<uint8_t> pixels(static_cast<size_t>(batch_ * kCifarPixels));
    at::Tensor labels = at::empty({batch_}, at::kLong);
    auto* l = labels.data_ptr<int64_t>();
    for (int64_t i = 0; i < batch_; ++i) {
      if (position_ >= static_cast<int64_t>(order_.size())) shuffle();
      const int64_t k = order_[position_++];
      l[i] = data_.labels[k];
      std::copy_n(data_.pixels.begin() + k * kCifarPixels, kCifarPixels,
                  pixels.begin() + i * kCifarPixels);
    }
    at::Tensor x = at::from_blob(pixels.data(), {batch_, 3, 32, 32}, at::kByte).to(at::kFloat);
    static const double kMean[3] = {0.4914, 0.4822, 0.4465}, kStd[3] = {0.2470, 0.2435, 0.2616};
    x.div_(255.0);
    for (int c = 0; c < 3; ++c) x.select(1, c).sub_(kMean[c]).div_(kStd[c]);
    return {x, labels};
  }

  std::string describe() const override {
    return "CIFAR-10, " + std::to_string(data_.size()) + " images from " +
           std::to_string(data_.files.size()) + " file(s)";
  }

 private:
  void shuffle() {
    at::Tensor perm = at::randperm(data_.size(), gen_, at::kLong);
    order_.assign(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + data_.size());
    position_ = 0;
  }

  Cifar10 data_;
  int64_t batch_;
  at::Generator gen_;
  std::vector<int64_t> order_;
  int64_t position_ = 0;
};

[[noreturn]] void bad_data(const std::string& message) { throw UsageError("--data: " + message); }

}  // namespace

std::unique_ptr<DataSource> synthetic_images(int64_t batch, int64_t classes, int64_t size,
                                             uint64_t seed) {
  return std::make_unique<SyntheticImages>(batch, classes, size, seed);
}

std::unique_ptr<DataSource> synthetic_regression(int64_t batch, int64_t in, int64_t out,
                                                 uint64_t seed) {
  return std::make_unique<SyntheticRegression>(batch, in, out, seed);
}

Cifar10 read_cifar10(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) bad_data("CIFAR-10 folder " + dir + " does not exist");
  if (!fs::is_directory(dir, ec)) bad_data(dir + " is not a folder (give the folder holding data_batch_*.bin)");
  Cifar10 data;
  static const std::regex kName(R"(data_batch_.*\.bin)");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (std::regex_match(it->path().filename().string(), kName)) data.files.push_back(it->path().string());
  }
  if (ec) bad_data("cannot list " + dir + ": " + ec.message());
  if (data.files.empty()) {
    bad_data("no data_batch_*.bin in " + dir +
             " (expected the CIFAR-10 binary version, the folder cifar-10-batches-bin)");
  }
  std::sort(data.files.begin(), data.files.end());
  for (const std::string& file : data.files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) bad_data("cannot read " + file);
    std::error_code size_ec;
    const auto file_size = fs::file_size(file, size_ec);
    if (size_ec) bad_data("cannot read " + file + ": " + size_ec.message());
    std::vector<char> bytes(static_cast<size_t>(file_size));
    if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) bad_data("cannot read " + file);
    const auto n = static_cast<int64_t>(bytes.size());
    if (n == 0) bad_data("garbled CIFAR-10 file " + file + ": it is empty");
    if (n % kCifarRecord != 0) {
      bad_data("garbled CIFAR-10 file " + file + ": " + std::to_string(n) +
               " bytes is not a whole number of records of 3073 bytes (1 label byte + 3072 "
               "pixel bytes)");
    }
    const int64_t records = n / kCifarRecord;
    data.labels.reserve(data.labels.size() + records);
    data.pixels.reserve(data.pixels.size() + records * kCifarPixels);
    for (int64_t r = 0; r < records; ++r) {
      const auto label = static_cast<uint8_t>(bytes[r * kCifarRecord]);
      if (label > 9) {
        bad_data("garbled CIFAR-10 file " + file + ": record " + std::to_string(r) +
                 " has label " + std::to_string(label) + " (labels are 0 to 9)");
      }
      data.labels.push_back(label);
      const auto* p = reinterpret_cast<const uint8_t*>(bytes.data() + r * kCifarRecord + 1);
      data.pixels.insert(data.pixels.end(), p, p + kCifarPixels);
    }
  }
  return data;
}

std::unique_ptr<DataSource> cifar10_batches(Cifar10 data, int64_t batch, uint64_t seed) {
  return std::make_unique<Cifar10Batches>(std::move(data), batch, seed);
}

std::unique_ptr<DataSource> make_data(const Config& c) {
  if (c.cifar10()) return cifar10_batches(read_cifar10(c.cifar_dir), c.batch, c.seed);
  if (c.model == "mlp") return synthetic_regression(c.batch, c.mlp_in, c.mlp_out, c.seed);
  return synthetic_images(c.batch, c.num_classes, c.image_size, c.seed);
}

}  // namespace memlean::trainer
