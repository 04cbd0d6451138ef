#include "run/checkpoint_bundle.h"

#include "core/error.h"
#include "io/checkpoint_dir.h"

namespace sigma {

CheckpointBundle load_checkpoint_bundle(const std::string& path,
                                        const std::function<void(const std::string&)>& after_model) {
  CheckpointBundle b;
  read_checkpoint(path, [&](const std::string& dir) {
    b.info = open_checkpoint(dir);  // verified: every file its manifest lists is there, intact
    // Which parts the checkpoint has is what its manifest lists, not what is on disk by the
    // time each is read: retention deletes a pruned checkpoint file by file, and a tokenizer
    // found missing then must fail the read (to be retried), not load a model without it.
    const auto listed = read_manifest(b.info.dir);
    b.model = Model::for_loading(b.info.cfg.model, b.info.cfg.train.seed);
    load_model(*b.model, b.info.dir);
    if (after_model) after_model(b.info.dir);
    b.tok.reset();
    if (listed.contains(kTokenizerFile))
      b.tok = data::Tokenizer::load(b.info.dir + "/" + kTokenizerFile);
    b.data_domains.reset();
    if (listed.contains(kDataDomainsFile)) {
      const auto own = checkpoint_data_domains(b.info.dir);
      SIGMA_CHECK(own.has_value(), "checkpoint '{}': {} is listed in its manifest but gone",
                  b.info.dir, kDataDomainsFile);
      b.data_domains = DomainRegistry::from_json(*own, b.info.dir + "/" + kDataDomainsFile,
                                                 DomainForm::Data);
    }
  });
  return b;
}

}  // namespace sigma
