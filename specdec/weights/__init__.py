"""Where a model's weights come from: hub ids, local paths and the embedded default (models), its
cached fp32 conversion (embedded), and the targets grown and drafts rounded from it (grow,
rounded). Loading only: nothing here runs a forward for a session."""
