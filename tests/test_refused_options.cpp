// Options that cannot apply are refused, not dropped (issue 25): each one given to a run or a
// command that would ignore it is an error naming the option and the mode, before anything is
// written.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "cli_util.h"

namespace {

using sigma::testing::sigma_cmd;
using sigma::testing::TempDir;

const std::string kTrain =
    "train --quiet --set model.d_model=16 --set model.heads=2 --set model.context=16 "
    "--set train.batch=2 --set train.steps=1 --set train.eval_rows=2 ";

// `args` fails with one line holding every piece of `want`.
void refused(const std::string& args, std::initializer_list<std::string> want) {
  const auto r = sigma_cmd(args);
  EXPECT_NE(r.code, 0) << args << ": " << r.out;
  for (const std::string& w : want) EXPECT_NE(r.out.find(w), std::string::npos) << args << ": " << r.out;
}

TEST(RefusedOptions, TheTinyRunItselfIsAccepted) {
  const auto r = sigma_cmd(kTrain);
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(RefusedOptions, AnExpertStoreOrMemoryWithExpertsInTheModel) {
  TempDir tmp("refused");
  refused(kTrain + "--set train.experts=model --expert-store " + tmp / "s.bin",
          {"train.expert_store = " + tmp / "s.bin" + " does not apply", "train.experts = model"});
  EXPECT_FALSE(std::filesystem::exists(tmp / "s.bin")) << "a refused run created the store";
  refused(kTrain + "--set train.experts=model --set train.expert_memory=1GiB",
          {"train.expert_memory = 1GiB does not apply", "ECSS compute buffers", "train.experts = model"});
  // A dense model resolves auto to model: the message says so.
  refused(kTrain + "--set model.rre_layers=0 --expert-store " + tmp / "s.bin",
          {"train.expert_store", "train.experts = auto (here: model)"});
  // Expert parallelism has per-rank stores but no ECSS compute buffers.
  refused(kTrain + "--set train.experts=parallel --set train.expert_memory=1GiB",
          {"train.expert_memory = 1GiB does not apply", "train.experts = parallel"});
}

TEST(RefusedOptions, ABadExpertMemoryInEveryMode) {
  for (const char* mode : {"model", "ecss", "vanilla", "parallel", "auto"})
    refused(kTrain + "--set train.experts=" + mode + " --set train.expert_memory=banana",
            {"train.expert_memory = 'banana': expected auto or a positive size"});
}

TEST(RefusedOptions, ModelOptionsTheModelDoesNotUse) {
  refused(kTrain + "--set model.rre_layers=0 --set model.router=top1",
          {"model.router = top1 does not apply", "dense"});
  refused(kTrain + "--set model.rre_layers=0 --set model.routing_seed=5",
          {"model.routing_seed = 5 does not apply", "dense"});
  refused(kTrain + "--set model.capacity_factor=2", {"model.capacity_factor = 2", "learned gate", "model.router = rre"});
  refused(kTrain + "--set model.aux_loss_weight=0.5", {"model.aux_loss_weight = 0.5", "model.router = rre"});
  refused(kTrain + "--set model.rre_layers=0 --set optim.eps_rre=0.125",
          {"optim.eps_rre = 0.125 does not apply", "dense"});
  refused(kTrain + "--set model.router=top1 --set model.routing=frequency",
          {"model.routing = frequency does not apply", "model.router = top1"});
}

TEST(RefusedOptions, DataOptionsTheSyntheticSourceDoesNotRead) {
  refused(kTrain + "--set data.path=/tmp/x", {"data.path = /tmp/x does not apply", "data.source = synthetic"});
  refused(kTrain + "--set data.tokenizer=t.json", {"data.tokenizer = ", "t.json does not apply", "data.source = synthetic"});
  refused(kTrain + "--set data.finetune=true", {"data.finetune = true does not apply", "data.source = synthetic"});
  refused(kTrain + "--set data.mask_prompt=true", {"data.mask_prompt = true does not apply", "fine-tuning"});
}

TEST(RefusedOptions, RunOptionsTheRunCannotUse) {
  refused(kTrain + "--set train.ckpt_every=5", {"train.ckpt_every = 5 does not apply", "--out"});
  refused(kTrain + "--set train.keep_checkpoints=2", {"train.keep_checkpoints = 2 does not apply", "--out"});
  TempDir tmp("refused_keep");
  refused(kTrain + "--set train.keep_every=10 --out " + tmp / "run",
          {"train.keep_every = 10 does not apply", "train.keep_checkpoints = 0 keeps them all"});
  EXPECT_FALSE(std::filesystem::exists(tmp / "run/checkpoints")) << "a refused run saved";
  EXPECT_EQ(sigma_cmd(kTrain + "--set train.keep_checkpoints=2 --set train.keep_every=10 --out " +
                      tmp / "ok").code, 0);
}

TEST(RefusedOptions, AnOverlapBoundWithoutOverlapOrOutOfRange) {
  refused(kTrain + "--set dist.overlap=false --set dist.overlap_mib=32",
          {"dist.overlap_mib = 32", "does not apply", "dist.overlap = false"});
  refused(kTrain + "--set dist.overlap_mib=-1", {"dist.overlap_mib", "-1 is out of range"});
  refused(kTrain + "--set dist.overlap_mib=lots", {"dist.overlap_mib", "cannot parse 'lots'"});
  EXPECT_EQ(sigma_cmd(kTrain + "--set dist.overlap_mib=0.5").code, 0);
}

// Refused before the checkpoint is opened: none is needed to see the refusal.
TEST(RefusedOptions, EvalAndGenerateFlagsTheirModeIgnores) {
  const std::string eval = "eval --ckpt /nonexistent ";
  for (const char* flag : {"--samples 3", "--k 2", "--temperature 1", "--max-new 5", "--timeout 3", "--memory-mb 100",
                           "--kv-cache bf16"})
    refused(eval + flag, {std::string(flag).substr(0, std::string(flag).find(' ')) + " does not apply",
                          "without --task"});
  for (const char* flag : {"--rows 5", "--batch 2", "--domains a"})
    refused(eval + "--task t.jsonl " + flag,
            {std::string(flag).substr(0, std::string(flag).find(' ')) + " does not apply", "--task scores"});
  refused(eval + "--task t.jsonl --top-k 5", {"--top-k does not apply", "greedily"});
  const std::string gen = "generate --ckpt /nonexistent --prompt 1 ";
  for (const char* flag : {"--top-k 5", "--top-p 0.5", "--seed 3"})
    refused(gen + flag, {std::string(flag).substr(0, std::string(flag).find(' ')) + " does not apply", "greedily"});
  // Sampling takes them: the error is then the missing checkpoint.
  refused(gen + "--no-cache --kv-cache bf16", {"--kv-cache does not apply", "--no-cache"});
  const auto r = sigma_cmd(gen + "--temperature 0.7 --top-k 5 --top-p 0.5 --seed 3");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out.find("does not apply"), std::string::npos) << r.out;
}

}  // namespace
