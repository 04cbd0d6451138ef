// A set of ranks for a message: sorted ranks as "0-3, 5".
#pragma once
#include <string>
#include <vector>

namespace sigma {

std::string rank_list(const std::vector<int>& ranks);

}  // namespace sigma
