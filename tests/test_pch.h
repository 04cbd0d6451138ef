// The external headers nearly every test file parses, precompiled once for all of them
// (CMakeLists.txt). Only headers from outside the project: a change to Sigma's own headers
// must not rebuild the precompiled header.
#pragma once
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
